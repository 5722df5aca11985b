"""The engine's side of `torch_autocast`: the forward's autocast context and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib

import torch

from zero.config import EngineConfig, NotSupportedError


def check_autocast(cfg: EngineConfig) -> None:
    """NotSupportedError when `torch_autocast` is combined with the fp16/bf16 sections (two ways to train in low
    precision: choose one, as DeepSpeed's docs say)."""
    if cfg.torch_autocast.enabled and (cfg.fp16.enabled or cfg.bf16.enabled):
        key = "fp16" if cfg.fp16.enabled else "bf16"
        raise NotSupportedError(f"config key 'torch_autocast.enabled': true together with '{key}.enabled'; choose "
                                "one (torch_autocast keeps fp32 parameters and autocasts the forward)")  # fmt: skip


def autocast_scaler(cfg: EngineConfig):
    """fp16 autocast: zero_core's DynamicLossScaler with ``torch.amp.GradScaler``'s defaults (scale 2^16, halved on
    every overflow, doubled after 2000 clean steps); None otherwise (bf16 needs no scaling)."""
    if not cfg.torch_autocast.enabled or cfg.torch_autocast.torch_dtype != torch.float16:
        return None
    from zero_core import DynamicLossScaler

    return DynamicLossScaler(init_scale=2.0**16, scale_window=2000, hysteresis=1, min_scale=2.0**-24)


class AutocastMixin:
    """Mixed into the Engine: ``_autocast()`` is the forward's context (a no-op unless `torch_autocast` is on)."""

    def _autocast(self):
        ac = self.config.torch_autocast
        if not ac.enabled:
            return contextlib.nullcontext()
        device = next(self.runtime.module.parameters()).device.type
        return torch.autocast(device_type=device, dtype=ac.torch_dtype)
