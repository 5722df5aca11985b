"""The engine's compiled paths: DeepCompile (``compile.deepcompile``, zero_compile's passes joined to the core's
seam) and plain ``torch_compile`` of the module over the eager engine."""

from __future__ import annotations

import os

import torch

from zero.config import EngineConfig
from zero.engine.runtime_protocol import BuiltRuntime


def compiled_path(cfg: EngineConfig, rank: int):
    """A ``zero_compile.core.CompiledPath`` for ``ZeroRuntime(param_store=..., grad_reduction=...)`` when
    ``compile.deepcompile`` is true, else None. ``double_buffer`` false turns the prefetch pass off; ``debug_log``
    dumps each pass's graph under ``compile.debug_dir/rank<r>``; ``offload_opt_states`` gives the path a master
    store (``path.master``) keeping ``opt_states_budget_bytes`` of optimizer state on the device."""
    c = cfg.compile
    if not c.deepcompile:
        return None
    from zero_compile.core import CompiledPath

    debug_dir = os.path.join(c.debug_dir, f"rank{rank}") if c.debug_log else None
    return CompiledPath(stage=cfg.zero_optimization.stage, backend=c.backend, warmup_steps=c.warmup_steps,
                        budget_bytes=c.memory_budget_bytes, prefetch=c.double_buffer, debug_dir=debug_dir,
                        offload_opt_states=c.offload_opt_states,
                        opt_states_budget_bytes=c.opt_states_budget_bytes)  # fmt: skip


def forward_callable(built: BuiltRuntime, cfg: EngineConfig):
    """What ``Engine.forward`` calls: DeepCompile's compiled forward, ``torch.compile(module)`` under
    ``torch_compile.enabled`` (eager while stage 3's store checks released reads), or the module itself."""
    if built.compiled_forward is not None:
        return built.compiled_forward
    module = built.runtime.module
    if cfg.torch_compile.enabled:
        compiled = torch.compile(module, backend=cfg.torch_compile.backend)
        if cfg.zero_optimization.stage == 3:  # stage 3's eager store: its first forward checks released reads
            return EagerWhileChecking(module, compiled, built.runtime.params)
        return compiled
    return module


class EagerWhileChecking:
    """``torch.compile(module)`` over stage 3's eager hooks: forwards run eagerly while the store checks released
    parameter reads (its first forward, before the first backward records the unit order), compiled after.

    The check is a torch function mode; active while Dynamo traces, it makes Dynamo read tensor attributes wrongly
    (transformers' Llama fails with ``arange() received ... device=torch.Size``, torch 2.13). The store's hooks are
    ``torch.compiler.disable``d, so compiled forwards graph-break at each module that gathers and run its
    collectives eagerly (as DeepSpeed's ZeRO-3 under ``torch.compile``).
    """

    def __init__(self, module: torch.nn.Module, compiled, store):
        self.module, self.compiled, self.store = module, compiled, store

    def __call__(self, *args, **kwargs):
        fn = self.module if self.store.checks_released_reads else self.compiled
        return fn(*args, **kwargs)
