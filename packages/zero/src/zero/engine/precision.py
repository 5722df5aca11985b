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
"""

from __future__ import annotations

import functools

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
    Neither: fp32 throughout. ``communication_data_type`` overrides the reduction dtype in every case.
    """
    from zero_core import PrecisionPolicy

    low = torch.bfloat16 if cfg.bf16.enabled else torch.float16 if cfg.fp16.enabled else None
    reduce = COMM_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else None
    if low is None:
        return PrecisionPolicy(reduce_dtype=reduce)
    native = device_type == "cuda" or (device_type == "cpu" and native_cpu_matmul(low, flags))
    compute = low if native else torch.float32
    return PrecisionPolicy(param_dtype=low, compute_dtype=compute, reduce_dtype=reduce or low)


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
