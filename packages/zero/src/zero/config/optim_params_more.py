"""`optimizer.params` of DeepSpeed's other optimizers: Lamb, Adagrad, Lion, OneBitAdam, ZeroOneAdam, OneBitLamb, Muon.

Keys and defaults are DeepSpeed's (``FusedLamb``; ``torch.optim.Adagrad`` / ``DeepSpeedCPUAdagrad``; ``FusedLion``;
``OnebitAdam``, ``ZeroOneAdam``, ``OnebitLamb`` of DeepSpeed <= 0.16, removed from 0.19). ``max_grad_norm`` is
refused as DeepSpeed's engine refuses it: clip with the top-level ``gradient_clipping``.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

_STRICT = pydantic.ConfigDict(extra="forbid")


class _Betas(pydantic.BaseModel):
    model_config = _STRICT
    betas: tuple[float, float] = (0.9, 0.999)

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class _NoClip(pydantic.BaseModel):
    model_config = _STRICT
    max_grad_norm: Literal[0, 0.0] = 0.0


class LambParams(_Betas, _NoClip):
    """`optimizer.params` for type Lamb (DeepSpeed's FusedLamb; zero.optim.Lamb)."""

    lr: PositiveFloat = 1e-3
    bias_correction: bool = True
    eps: PositiveFloat = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: NonNegativeFloat = 0.0
    max_coeff: PositiveFloat = 10.0
    min_coeff: NonNegativeFloat = 0.01
    amsgrad: Literal[False] = False


class AdagradParams(pydantic.BaseModel):
    """`optimizer.params` for type Adagrad (torch.optim.Adagrad; DeepSpeedCPUAdagrad's defaults lr 1e-2, eps 1e-10)."""

    model_config = _STRICT
    lr: PositiveFloat = 1e-2
    lr_decay: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0
    initial_accumulator_value: NonNegativeFloat = 0.0
    eps: PositiveFloat = 1e-10
    amsgrad: Literal[False] = False


class LionParams(_Betas):
    """`optimizer.params` for type Lion (DeepSpeed's FusedLion / DeepSpeedCPULion; zero.optim.Lion)."""

    lr: PositiveFloat = 1e-3
    weight_decay: NonNegativeFloat = 0.0


class _OneBitCommon(_Betas, _NoClip):
    lr: PositiveFloat = 1e-3
    bias_correction: bool = True
    eps: PositiveFloat = 1e-8
    eps_inside_sqrt: bool = False
    weight_decay: NonNegativeFloat = 0.0
    amsgrad: Literal[False] = False
    # DeepSpeed chose its transport with these; zero_comm runs over the engine's process group whatever they say.
    cuda_aware: bool = False
    comm_backend_name: Literal["nccl", "mpi", "hccl", "compressed", "gloo"] = "nccl"


class OneBitAdamParams(_OneBitCommon):
    """`optimizer.params` for type OneBitAdam: Adam for ``freeze_step`` steps, then 1-bit compressed momentum."""

    freeze_step: NonNegativeInt = 100000


class ZeroOneAdamParams(_OneBitCommon):
    """`optimizer.params` for type ZeroOneAdam (0/1 Adam): variance updated at exponentially spaced steps until
    ``var_freeze_step``, 1-bit gradients in between, then local steps synchronised every 1, 2, 4, ... steps
    (doubling every ``local_step_scaler`` steps, at most ``local_step_clipper``)."""

    var_freeze_step: NonNegativeInt = 100000
    var_update_scaler: PositiveInt = 16
    local_step_scaler: PositiveInt = 32678
    local_step_clipper: PositiveInt = 16


class OneBitLambParams(_OneBitCommon):
    """`optimizer.params` for type OneBitLamb (1-bit LAMB): LAMB for ``freeze_step`` steps, then 1-bit compressed
    momentum with the frozen trust ratio scaled by an adaptive factor (``factor_*``, ``coeff_beta``)."""

    freeze_step: NonNegativeInt = 100000
    max_coeff: PositiveFloat = 10.0
    min_coeff: NonNegativeFloat = 0.01
    coeff_beta: NonNegativeFloat = 0.9
    factor_max: PositiveFloat = 4.0
    factor_min: PositiveFloat = 0.5
    factor_threshold: PositiveFloat = 0.1


class MuonParams(_NoClip):
    """`optimizer.params` for type Muon (DeepSpeed 0.19.8's ``MuonWithAuxAdam``; zero.optim.muon.Muon).

    Hidden matrices (>= 2 dimensions, name without ``embed`` / ``lm_head``) step Muon with ``muon_lr`` (else
    ``lr``, else 0.02), ``momentum``, ``weight_decay``, ``ns_method``; the rest AdamW with ``adam_lr`` (else
    ``lr``, else 3e-4), ``betas``, ``eps``, ``weight_decay`` (``adam_w_mode`` false: L2 decay). ``torch_adam``
    is accepted (the auxiliary Adam is the same update either way); ``per_head_muon`` only false.
    ``qk_clip_threshold`` (zero's own key, beyond DeepSpeed): MuonClip, Kimi K2's QK-clip with this ``tau``
    (``zero.optim.qk_clip``; the model registers its attention projections and reports its max logits)."""

    lr: NonNegativeFloat | None = None
    muon_lr: NonNegativeFloat | None = None
    adam_lr: NonNegativeFloat | None = None
    momentum: float = pydantic.Field(0.95, ge=0.0, lt=1.0)
    weight_decay: NonNegativeFloat = 0.0
    ns_method: Literal["gram", "standard"] = "gram"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: NonNegativeFloat = 1e-10
    adam_w_mode: bool = True
    torch_adam: bool = False
    per_head_muon: Literal[False] = False
    qk_clip_threshold: PositiveFloat | None = None

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


MORE_OPTIMIZER_PARAMS: dict[str, type[pydantic.BaseModel]] = {
    "lamb": LambParams, "adagrad": AdagradParams, "lion": LionParams, "onebitadam": OneBitAdamParams,
    "zerooneadam": ZeroOneAdamParams, "onebitlamb": OneBitLambParams, "muon": MuonParams,
}  # fmt: skip
# The communication-compressed ones: stage 0 only (DeepSpeed: "1bit-Adam is not compatible with ZeRO").
COMPRESSED_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})
