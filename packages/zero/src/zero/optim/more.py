"""Builders for DeepSpeed's other optimizer types: Lamb, Adagrad, Lion, the 1-bit family and Muon.

* ``Lamb`` -> :class:`zero.optim.lamb.Lamb` (ours: torch has none), per-parameter trust ratios at every stage
  (:func:`zero.optim.bind.bind_runtime` tells it the layout).
* ``Adagrad`` -> ``torch.optim.Adagrad`` (what DeepSpeed itself builds when its CPU Adagrad is not used).
* ``Lion`` -> :class:`zero.optim.lion.Lion` (ours: torch has none).
* ``OneBitAdam`` / ``ZeroOneAdam`` / ``OneBitLamb`` -> :mod:`zero.optim.onebit` (stage 0 only, as DeepSpeed).
* ``Muon`` -> :class:`zero.optim.muon.Muon` over :func:`zero.optim.muon_groups.muon_param_groups` (hidden
  matrices Muon, the rest AdamW; zero_core assembles each matrix whole under ZeRO).
"""

from __future__ import annotations

import torch

from zero.config.optim_params_more import (
    AdagradParams,
    LambParams,
    LionParams,
    MuonParams,
    OneBitAdamParams,
    OneBitLambParams,
    ZeroOneAdamParams,
)


def build_more(typed, params: list, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """The optimizer for validated ``optimizer.params`` of one of this module's types over ``params`` (Muon also
    needs ``model``: parameter names decide which use Muon). Raises ValueError for Muon without ``model``."""
    if isinstance(typed, MuonParams):
        from zero.optim.muon import Muon
        from zero.optim.muon_groups import muon_param_groups

        if model is None:
            raise ValueError("optimizer type Muon needs the model (names and shapes decide which parameters use Muon)")
        return Muon(muon_param_groups(params, model, typed), adam_w_mode=typed.adam_w_mode,
                    qk_clip_threshold=typed.qk_clip_threshold)  # fmt: skip
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
