"""Builders for DeepSpeed's other optimizer types: Lamb, Adagrad, Lion and the 1-bit family.

* ``Lamb`` -> :class:`zero.optim.lamb.Lamb` (ours: torch has none), per-parameter trust ratios at every stage
  (:func:`zero.optim.bind.bind_runtime` tells it the layout).
* ``Adagrad`` -> ``torch.optim.Adagrad`` (what DeepSpeed itself builds when its CPU Adagrad is not used).
* ``Lion`` -> :class:`zero.optim.lion.Lion` (ours: torch has none).
* ``OneBitAdam`` / ``ZeroOneAdam`` / ``OneBitLamb`` -> :mod:`zero.optim.onebit` (stage 0 only, as DeepSpeed).
"""

from __future__ import annotations

import torch

from zero.config.optim_params_more import (
    AdagradParams,
    LambParams,
    LionParams,
    OneBitAdamParams,
    OneBitLambParams,
    ZeroOneAdamParams,
)


def build_more(typed, params: list) -> torch.optim.Optimizer:
    """The optimizer for validated ``optimizer.params`` of one of this module's types over ``params``."""
    kw = typed.model_dump(exclude={"max_grad_norm", "amsgrad", "cuda_aware", "comm_backend_name"})
    if isinstance(typed, LambParams):
        from zero.optim.lamb import Lamb

        return Lamb(params, **kw)
    if isinstance(typed, AdagradParams):
        return torch.optim.Adagrad(params, **kw)
    if isinstance(typed, LionParams):
        from zero.optim.lion import Lion

        return Lion(params, **kw)
    if isinstance(typed, (OneBitAdamParams, ZeroOneAdamParams, OneBitLambParams)):
        from zero.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

        kinds = {OneBitAdamParams: OneBitAdam, ZeroOneAdamParams: ZeroOneAdam, OneBitLambParams: OneBitLamb}
        return kinds[type(typed)](params, **kw)
    raise TypeError(f"build_more: no builder for {type(typed).__name__}")
