"""Optimizers from the `optimizer` config section: Adam, AdamW, SGD with DeepSpeed's key semantics."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zero.config.errors import NotSupportedError
from zero.config.optim_params_more import MORE_OPTIMIZER_PARAMS
from zero.config.optim_sections import AdamParams, OptimizerSection, SGDParams
from zero.optim.more import build_more


def _kernel_adam():
    """zero_kernels' CPU Adam class when that package provides one, else None."""
    try:
        import zero_kernels
    except ImportError:
        return None
    return getattr(zero_kernels, "CPUAdam", None)


def _adam(params: list, p: AdamParams, adamw: bool) -> torch.optim.Optimizer:
    decoupled = adamw or p.adam_w_mode
    kwargs = dict(lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay)
    if not p.bias_correction:
        raise NotSupportedError("config key 'optimizer.params.bias_correction': false is not supported yet by zero")
    if p.torch_adam:
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, amsgrad=p.amsgrad, **kwargs)
    kernel = _kernel_adam()
    on_cpu = all(t.device.type == "cpu" for g in params for t in (g["params"] if isinstance(g, dict) else [g]))
    if kernel is not None and on_cpu:
        return kernel(params, adamw_mode=decoupled, **kwargs)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, fused=True, **kwargs)  # torch's fused kernel: fastest torch path on CPU and GPU


def build_optimizer(section: OptimizerSection, params: Iterable, model: torch.nn.Module | None = None
                    ) -> torch.optim.Optimizer:  # fmt: skip
    """A torch optimizer for the config's `optimizer` section over ``params`` (tensors or param-group dicts).

    DeepSpeed semantics: type ``Adam`` with ``adam_w_mode`` (default true) is AdamW; ``torch_adam: true`` uses
    ``torch.optim.Adam``/``AdamW`` as is; otherwise zero-kernels' CPU Adam when built and the parameters are on the
    CPU, else torch's fused Adam/AdamW. ``SGD`` is ``torch.optim.SGD``. Lamb, Adagrad, Lion, OneBitAdam,
    ZeroOneAdam, Muon (which needs ``model``): see :mod:`zero.optim.more`.

    Raises: ConfigError / NotSupportedError naming the key (see OptimizerSection.typed_params).
    """
    typed = section.typed_params()
    params = list(params)
    if section.type.lower() in MORE_OPTIMIZER_PARAMS:
        return build_more(typed, params, model)
    if isinstance(typed, SGDParams):
        return torch.optim.SGD(params, **typed.model_dump())
    return _adam(params, typed, adamw=section.type.lower() == "adamw")
