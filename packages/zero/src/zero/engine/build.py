"""Build zero_core's ZeroRuntime for a config: precision policy, loss scaler, clipping."""

from __future__ import annotations

import torch

from zero.config import EngineConfig
from zero_core import DynamicLossScaler, PrecisionPolicy, StaticLossScaler, ZeroRuntime


def precision_policy(cfg: EngineConfig, device_type: str) -> PrecisionPolicy:
    """bf16: bf16 storage/communication, bf16 compute on GPUs, fp32 compute on CPUs (bf16 matmul was ~100x slower
    than fp32 on the reference CPU, baselines.md); fp16: fp16 throughout with fp32 masters; else fp32."""
    if cfg.bf16.enabled:
        return PrecisionPolicy.bf16(torch.bfloat16 if device_type == "cuda" else torch.float32)
    if cfg.fp16.enabled:
        return PrecisionPolicy.fp16()
    return PrecisionPolicy.fp32()


def loss_scaler(cfg: EngineConfig):
    """DeepSpeed's rule: fp16 with ``loss_scale: 0`` -> dynamic scaler; fp16 with a fixed value -> static; else None."""
    f = cfg.fp16
    if not f.enabled:
        return None
    if f.loss_scale:
        return StaticLossScaler(f.loss_scale)
    return DynamicLossScaler.from_deepspeed(f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale)


def build_runtime(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: EngineConfig, group=None):
    """A ``zero_core.ZeroRuntime`` training ``model`` with ``optimizer`` as ``cfg`` says (stage, precision, clip)."""
    device_type = next(model.parameters()).device.type
    return ZeroRuntime(model, optimizer, config=cfg.zero_optimization, precision=precision_policy(cfg, device_type),
                       group=group, gradient_clipping=cfg.gradient_clipping, loss_scaler=loss_scaler(cfg))  # fmt: skip
