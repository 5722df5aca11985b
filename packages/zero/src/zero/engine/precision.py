"""DeepSpeed's ``fp16`` / ``bf16`` / ``communication_data_type`` keys -> zero_core's ``PrecisionPolicy``.

The rule for the compute dtype (the dtype the forward runs in):

* CUDA: the low-precision dtype itself (bf16 or fp16), as DeepSpeed.
* CPU: the low-precision dtype only when the CPU has native matrix instructions for it, read from the Linux CPU
  flags: ``amx_bf16`` or ``avx512_bf16`` for bf16, ``amx_fp16`` for fp16. Otherwise fp32 compute, with the
  low-precision dtype kept for parameter storage and communication. Why: on a CPU without them (an AVX2 Zen 3 in
  ../shared/design/baselines.md) bf16 matmul ran ~100x slower than fp32 (0.5 vs 58 GFLOP/s); on a Xeon with AMX
  a 256^3 bf16 matmul ran ~6x faster than fp32 (527 vs 83 GFLOP/s, one thread). Where the flags cannot be read
  (no ``/proc/cpuinfo``) compute stays fp32.

``communication_data_type`` ("fp32", "fp16", "bf16"; DeepSpeed's top-level key) sets the gradient reduction
dtype; by default it is the parameter dtype (bf16/fp16 runs reduce in bf16/fp16, as DeepSpeed).
``data_types.grad_accum_dtype`` sets the gradient accumulation dtype (default fp32); ``data_types.buffer_dtype``
and ``keep_in_fp32_modules`` set the buffers' dtypes (:func:`cast_buffers`).
"""

from __future__ import annotations

import functools
import re

import torch

from zero.config import EngineConfig

COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# CPU flags (as /proc/cpuinfo spells them) that make a low-precision matmul at least as fast as fp32.
NATIVE_CPU_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16",)}
_announced: set[str] = set()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of the first processor in ``/proc/cpuinfo``; empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_cpu_matmul(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or ``flags``) has matrix instructions for ``dtype`` (fp32: always True)."""
    if dtype == torch.float32:
        return True
    have = cpu_flags() if flags is None else flags
    return any(f in have for f in NATIVE_CPU_FLAGS.get(dtype, ()))


def precision_policy(cfg: EngineConfig, device_type: str, flags: frozenset[str] | None = None):
    """The ``zero_core.PrecisionPolicy`` for ``cfg`` on ``device_type`` ("cpu"/"cuda"); see the module docstring.

    bf16: bf16 parameters and communication, fp32 master weights and gradient accumulation (no loss scaling).
    fp16: fp16 parameters and communication, fp32 master and accumulation (loss scaler from :func:`loss_scaler`).
    Neither: fp32 throughout. ``communication_data_type`` overrides the reduction dtype in every case;
    ``data_types.grad_accum_dtype`` sets the accumulation dtype (None: fp32). An explicit "fp32" with bf16/fp16 at
    stages 0/1 (which reduce the accumulated sum once, at the boundary) also reduces in fp32 unless
    ``communication_data_type`` says otherwise, so no micro-batch is lost to rounding (DeepSpeed 0.19.8 reduces in
    bf16 there: set ``communication_data_type: "bf16"`` for its numbers); at stages 2/3 (a reduction
    per micro-batch, added into fp32 shards) it is the run without the key, bitwise.
    """
    from zero_core import PrecisionPolicy

    low = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else None
    reduce = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    accum_name = cfg.data_types.grad_accum_dtype
    accum = None if accum_name in (None, "fp32") else COMM_DTYPES[accum_name]
    if low is None:
        return PrecisionPolicy(reduce_dtype=reduce, grad_accum_dtype=accum)
    if accum_name == "fp32" and cfg.zero_optimization.stage <= 1 and reduce is None:
        # stages 0/1 reduce the micro-batches' sum once, at the boundary: in fp32, or the sum is rounded to the
        # low dtype after all. DeepSpeed 0.19.8's BF16_Optimizer rounds it (communication_data_type, default bf16);
        # `communication_data_type: "bf16"` gives its numbers bitwise
        reduce = torch.float32
    native = device_type == "cuda" or (device_type == "cpu" and native_cpu_matmul(low, flags))
    compute = low if native else torch.float32
    return PrecisionPolicy(param_dtype=low, compute_dtype=compute, reduce_dtype=reduce or low, grad_accum_dtype=accum)


def keep_in_fp32_pattern(module: torch.nn.Module, setting, dtype: torch.dtype | None) -> re.Pattern | None:
    """The names of ``module``'s buffers kept in fp32 under ``dtype`` training (``data_types.keep_in_fp32_modules``:
    "auto" reads transformers' ``_keep_in_fp32_modules_strict``, plus ``_keep_in_fp32_modules`` under fp16, of every
    submodule; a list gives name patterns where ``*`` is any characters), as DeepSpeed 0.19.8; None when nothing is
    kept (fp32 training, an empty list, a model without the lists)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns = set()
    if setting == "auto":
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                body = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(prefix)}\..*{body}" if prefix else body)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


@torch.no_grad()
def cast_buffers(module: torch.nn.Module, cfg: EngineConfig) -> None:
    """Apply ``data_types.buffer_dtype`` and ``keep_in_fp32_modules`` to ``module``'s floating-point buffers in place:
    kept buffers become fp32, the others ``buffer_dtype`` when it is set (else they keep their dtype), as
    DeepSpeed's engine does at initialisation. Parameters are not touched (the runtime stores them)."""
    low = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else None
    pattern = keep_in_fp32_pattern(module, cfg.data_types.keep_in_fp32_modules, low)
    target = COMM_DTYPES.get(cfg.data_types.buffer_dtype)
    for prefix, owner in module.named_modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is None or not buf.is_floating_point():
                continue
            full = f"{prefix}.{name}" if prefix else name
            dtype = torch.float32 if pattern is not None and pattern.search(full) else target
            if dtype is not None and buf.dtype != dtype:
                buf.data = buf.data.to(dtype)


def announce(policy, device_type: str, rank: int) -> None:
    """Say once per process (rank 0) when low-precision storage runs with fp32 compute on this CPU."""
    if device_type != "cpu" or policy.param_dtype == policy.compute or rank != 0:
        return
    name = str(policy.param_dtype).removeprefix("torch.")
    if name in _announced:
        return
    _announced.add(name)
    flags = "/".join(NATIVE_CPU_FLAGS.get(policy.param_dtype, ()))
    print(f"zero: {name} enabled on a CPU without native {name} matrix units (no {flags}): compute in fp32, "
          f"{name} for parameter storage and communication", flush=True)  # fmt: skip


def loss_scaler(cfg: EngineConfig):
    """DeepSpeed's rule: fp16 with ``loss_scale: 0`` -> dynamic scaler from ``initial_scale_power``,
    ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``; fp16 with a value > 0 ->
    that static scale; bf16/fp32 -> None (zero_core uses a static scale of 1, still skipping non-finite steps)."""
    from zero_core import DynamicLossScaler, StaticLossScaler

    f = cfg.fp16
    if not f.enabled:
        return None
    if f.loss_scale > 0:
        return StaticLossScaler(f.loss_scale)
    return DynamicLossScaler(init_scale=2.0**f.initial_scale_power, scale_window=f.loss_scale_window,
                             hysteresis=f.hysteresis, min_scale=float(f.min_loss_scale),
                             consecutive_hysteresis=f.consecutive_hysteresis)  # fmt: skip


def cast_inputs(obj, dtype: torch.dtype):
    """``obj`` with every floating-point tensor (inside tuples, lists and dicts too) cast to ``dtype``; integer
    tensors (token ids, labels) and other objects untouched. DeepSpeed's engine does this for fp16/bf16 inputs."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(cast_inputs(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_inputs(v, dtype) for k, v in obj.items()}
    return obj
