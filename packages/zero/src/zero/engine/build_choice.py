"""Which runtime a config and optimizer get: zero_core's ``ZeroRuntime`` (bound to layout-aware optimizers such as
LAMB), or, for the 1-bit optimizers, :class:`zero.optim.onebit.CompressedRuntime` (stage 0, fp32, as DeepSpeed
runs them)."""

from __future__ import annotations

import torch

from zero.config import EngineConfig, NotSupportedError
from zero.engine.autocast import autocast_scaler, check_autocast
from zero.engine.build import build_runtime
from zero.engine.checkpoint_io import ZeroCoreCheckpoints, group_names
from zero.engine.runtime_protocol import BuiltRuntime
from zero.optim.bind import bind_runtime
from zero.optim.muon import Muon
from zero_parallel import layout_of


def check_muon(optimizer: torch.optim.Optimizer, cfg: EngineConfig) -> None:
    """Refuse what zero's Muon cannot serve (NotSupportedError naming the key, Muon and the stage): its
    whole-matrix step runs in zero_core's device master store or on the host with ``offload_optimizer`` cpu, so
    NVMe offload, SuperOffload, Twin-Flow's ``ratio`` < 1 and ``compile.offload_opt_states`` are refused. Stages
    0-3, fp32 / bf16 / fp16 are served."""
    if not isinstance(optimizer, Muon):
        return
    off = cfg.zero_optimization.offload_optimizer
    stage = cfg.zero_optimization.stage
    if off is not None and off.device == "nvme":
        raise NotSupportedError(f"config key 'zero_optimization.offload_optimizer.device': 'nvme' with optimizer "
                                f"Muon at stage {stage} is not supported yet by zero (Muon's momentum stays in "
                                "memory); use device 'cpu' or 'none'")  # fmt: skip
    if off is not None and off.device == "cpu" and (off.super_offload or off.ratio < 1):
        key = "super_offload" if off.super_offload else "ratio"
        raise NotSupportedError(f"config key 'zero_optimization.offload_optimizer.{key}': {getattr(off, key)!r} with "
                                f"optimizer Muon at stage {stage} is not supported yet by zero (Muon steps whole "
                                "matrices on the host after the boundary); leave it at its default")  # fmt: skip
    if cfg.compile.offload_opt_states:
        raise NotSupportedError(f"config key 'compile.offload_opt_states': true with optimizer Muon at stage {stage} "
                                "is not supported yet by zero (Muon steps in device memory); set it false")  # fmt: skip


def build_engine_runtime(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: EngineConfig, group=None,
                         model_parallel=None) -> BuiltRuntime:  # fmt: skip
    """The runtime (with its checkpoint format and DeepCompile's forward) for ``model``/``optimizer`` under
    ``cfg``, sharding over ``group`` (None: the whole world; the sequence-data-parallel group under sequence
    parallelism; the data-parallel group under AutoTP, whose layout is ``model_parallel``:
    ``zero_core.model_parallel.ModelParallel``).

    Raises:
        NotSupportedError: a 1-bit optimizer (OneBitAdam, ZeroOneAdam, OneBitLamb) with ``zero_optimization.stage`` > 0
            (DeepSpeed: "1bit-Adam is not compatible with ZeRO") or with fp16/bf16/torch_autocast (zero runs
            them in fp32) or with a ``group`` (they compress over the whole world); `torch_autocast` with fp16 or
            bf16; Muon with an optimizer state that zero keeps off
            the device (see :func:`check_muon`). Checked before any communication.
    """
    from zero.optim.onebit import CompressedRuntime
    from zero.optim.onebit.base import CompressedOptimizer
    from zero.optim.onebit.checkpoint import CompressedCheckpoints

    check_autocast(cfg)
    check_muon(optimizer, cfg)
    if isinstance(optimizer, CompressedOptimizer):
        name = type(optimizer).__name__
        if group is not None:
            raise NotSupportedError(f"initialize(mpu=...) or tensor_parallel with optimizer {name}: the 1-bit "
                                    "optimizers compress over the whole world; use Adam or AdamW with sequence or "
                                    "tensor parallelism")  # fmt: skip
        if cfg.zero_optimization.stage != 0:
            raise NotSupportedError(f"config key 'zero_optimization.stage': {name} runs at stage 0 only (DeepSpeed: "
                                    "the 1-bit optimizers are not compatible with ZeRO); set stage 0, or use Adam "
                                    "at stages 1-3")  # fmt: skip
        for key in ("fp16", "bf16", "torch_autocast"):
            if getattr(cfg, key).enabled:
                raise NotSupportedError(f"config key '{key}.enabled': {name} runs in fp32 in zero; set it false")
        runtime = CompressedRuntime(model, optimizer, gradient_clipping=cfg.gradient_clipping)
        return BuiltRuntime(runtime, CompressedCheckpoints(runtime))
    param_order = group_names(model, optimizer)  # before the runtime rebinds the groups to its shards
    if cfg.torch_autocast.enabled:  # fp32 state, autocast forward; fp16 gets a gradient scaler
        from zero_core import PrecisionPolicy, ZeroRuntime

        runtime = ZeroRuntime(model, optimizer, config=cfg.zero_optimization, precision=PrecisionPolicy(), group=group,
                              gradient_clipping=cfg.gradient_clipping, loss_scaler=autocast_scaler(cfg),
                              model_parallel=model_parallel)  # fmt: skip
        compiled = None
    else:
        runtime, compiled = build_runtime(model, optimizer, cfg, group, model_parallel)
    bind_runtime(runtime.optimizer, runtime)
    checkpoints = ZeroCoreCheckpoints(runtime, layout_of(model), cfg.checkpoint.format, param_order)
    return BuiltRuntime(runtime, checkpoints, compiled)
