"""``InferenceEngine.compile``: DeepSpeed 0.19.8's ``engine.compile(backend, compile_kwargs)``, in zero as two compiled
callables over the unchanged module.

* ``forward``: ``torch.compile(module, backend=..., **compile_kwargs)`` (DeepSpeed compiles the module in place).
* ``generate``: the one-token decode step is compiled once, through transformers' own switch (a ``CompileConfig``
  given to ``generate``: the prefill runs eagerly, every later step calls one compiled ``__call__``). With the
  static KV cache of the fused blocks the decode step's shapes do not change from token to token, so it is traced
  and compiled on the first decode step only (``dynamic=False``) and reused by later ``generate`` calls of the same
  batch size and cache length; zero's own decode loop (:mod:`zero_inference.decode`), where it applies, compiles
  its one-token step with the same arguments instead. transformers compiles only on accelerators unless asked;
  zero asks on the CPU too.

On the CPU inductor writes C++ and needs a C++ compiler (``CXX`` or ``c++``/``g++``/``clang++`` on the PATH).
"""

from __future__ import annotations

import os
import shutil

import torch


class CompileError(RuntimeError):
    """``compile`` cannot work here: the message names the cause and what to use instead."""


def check_backend(backend: str, device: torch.device) -> None:
    """Raises :class:`CompileError` for inductor on the CPU without a C++ compiler."""
    if backend != "inductor" or device.type != "cpu":
        return
    candidates = [os.environ.get("CXX"), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        raise CompileError("InferenceEngine.compile: inductor on the CPU needs a C++ compiler (set CXX or put g++ "
                           "or clang++ on the PATH); or pass backend='aot_eager', which needs none")  # fmt: skip


def decode_compile_config(backend: str, compile_kwargs: dict):
    """transformers' ``CompileConfig`` for the decode step: ``backend``, mode "default" (no CUDA graphs),
    ``dynamic=False``, ``fullgraph=False``, overridden by ``compile_kwargs`` (its ``fullgraph``, ``dynamic``,
    ``mode``, ``options``); compiling on every device.

    Raises:
        TypeError: a key of ``compile_kwargs`` that ``CompileConfig`` does not take.
    """
    from transformers import CompileConfig  # only generate needs it; a plain module compiles without transformers

    fields = {"fullgraph": False, "dynamic": False, "mode": "default", "options": None}
    unknown = set(compile_kwargs) - set(fields)
    if unknown:
        raise TypeError(f"InferenceEngine.compile: compile_kwargs {sorted(unknown)} not understood; it takes "
                        f"{sorted(fields)} (torch.compile's)")  # fmt: skip
    config = CompileConfig(backend=backend, **{**fields, **compile_kwargs})
    config._compile_all_devices = True  # transformers' switch to compile the decode step on a CPU too
    return config
