"""The `optimizer` and `scheduler` sections: a type name plus type-specific params, each validated strictly."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from zero.config.errors import ConfigError, NotSupportedError, format_validation_error, nearest
from zero.config.optim_params_more import MORE_OPTIMIZER_PARAMS

_STRICT = pydantic.ConfigDict(extra="forbid")
FloatOrList = NonNegativeFloat | list[NonNegativeFloat]


class AdamParams(pydantic.BaseModel):
    """`optimizer.params` for type Adam / AdamW (DeepSpeed's FusedAdam/DeepSpeedCPUAdam keys).

    As in DeepSpeed, type ``Adam`` defaults to ``adam_w_mode: true`` (decoupled weight decay, i.e. AdamW); set it
    false for L2 (coupled) decay. ``torch_adam: true`` selects ``torch.optim.Adam``/``AdamW`` (non-fused) instead of
    zero-kernels' CPU Adam or torch's fused kernel.
    """

    model_config = _STRICT
    lr: NonNegativeFloat = 1e-3  # 0 is valid in torch and where warmup schedules start
    betas: tuple[float, float] = (0.9, 0.999)
    eps: NonNegativeFloat = 1e-8  # torch accepts eps >= 0
    weight_decay: NonNegativeFloat = 0.0
    adam_w_mode: bool = True
    torch_adam: bool = False
    bias_correction: bool = True
    amsgrad: bool = False

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("each beta must be in [0, 1)")
        return v


class SGDParams(pydantic.BaseModel):
    """`optimizer.params` for type SGD (torch.optim.SGD's arguments)."""

    model_config = _STRICT
    lr: NonNegativeFloat = 1e-3
    momentum: NonNegativeFloat = 0.0
    dampening: NonNegativeFloat = 0.0
    weight_decay: NonNegativeFloat = 0.0
    nesterov: bool = False


OPTIMIZER_PARAMS: dict[str, type[pydantic.BaseModel]] = {"adam": AdamParams, "adamw": AdamParams, "sgd": SGDParams}
OPTIMIZER_PARAMS.update(MORE_OPTIMIZER_PARAMS)  # Lamb, Adagrad, Lion, OneBitAdam, ZeroOneAdam, OneBitLamb, Muon
# DeepSpeed optimizers that zero does not have (yet): a config naming one gets "not supported yet", not a typo hint.
DEEPSPEED_ONLY_OPTIMIZERS = {"muonwithauxadam"}
OPTIMIZER_NAMES = ["Adam", "AdamW", "SGD", "Lamb", "Adagrad", "Lion", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Muon"]


class WarmupLRParams(pydantic.BaseModel):
    """`scheduler.params` of WarmupLR: lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps steps.

    ``warmup_max_lr`` unset (None) takes the optimizer's lr, as DeepSpeed 0.19.8."""

    model_config = _STRICT
    warmup_min_lr: FloatOrList = 0.0
    warmup_max_lr: FloatOrList | None = None
    warmup_num_steps: PositiveInt = 1000
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = Field(default=-1, ge=-1)


class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` of WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps.

    Its ``warmup_max_lr`` defaults to 1e-3 (DeepSpeed 0.19.8's WarmupDecayLR default; WarmupLR's is the optimizer's
    lr)."""

    warmup_max_lr: FloatOrList | None = 1e-3
    total_num_steps: PositiveInt


class WarmupCosineLRParams(pydantic.BaseModel):
    """`scheduler.params` of WarmupCosineLR: ratios of the optimizer's lr; warmup then cosine to cos_min_ratio."""

    model_config = _STRICT
    total_num_steps: PositiveInt
    warmup_min_ratio: NonNegativeFloat = 0.0
    warmup_num_steps: PositiveInt = 1000
    cos_min_ratio: NonNegativeFloat = 1e-4
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = Field(default=-1, ge=-1)


class OneCycleParams(pydantic.BaseModel):
    """`scheduler.params` of OneCycle (1cycle policy, Smith 2018): one triangular cycle, then optional decay."""

    model_config = _STRICT
    cycle_min_lr: NonNegativeFloat
    cycle_max_lr: NonNegativeFloat
    decay_lr_rate: NonNegativeFloat = 0.0
    cycle_first_step_size: PositiveInt = 2000
    cycle_second_step_size: NonNegativeInt | None = None
    cycle_first_stair_count: NonNegativeInt = 0
    cycle_second_stair_count: NonNegativeInt | None = None
    decay_step_size: NonNegativeInt = 0
    cycle_momentum: bool = True
    cycle_min_mom: NonNegativeFloat = 0.8
    cycle_max_mom: NonNegativeFloat = 0.9
    decay_mom_rate: NonNegativeFloat = 0.0
    last_batch_iteration: int = Field(default=-1, ge=-1)


class LRRangeTestParams(pydantic.BaseModel):
    """`scheduler.params` of LRRangeTest: lr grows from lr_range_test_min_lr by step_rate every step_size steps."""

    model_config = _STRICT
    lr_range_test_min_lr: FloatOrList = 1e-3
    lr_range_test_step_size: PositiveInt = 2000
    lr_range_test_step_rate: NonNegativeFloat = 1.0
    lr_range_test_staircase: bool = False
    last_batch_iteration: int = Field(default=-1, ge=-1)


SCHEDULER_PARAMS: dict[str, type[pydantic.BaseModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
DEEPSPEED_ONLY_SCHEDULERS: set[str] = set()


class OptimizerSection(pydantic.BaseModel):
    """The `optimizer` section: ``{"type": "AdamW", "params": {...}}``. ``params`` is checked against the type."""

    model_config = _STRICT
    type: str
    params: dict = Field(default_factory=dict)

    def typed_params(self) -> pydantic.BaseModel:
        """The params validated for this type. Raises ConfigError / NotSupportedError naming the key."""
        key = self.type.lower()
        if key in DEEPSPEED_ONLY_OPTIMIZERS:
            raise NotSupportedError(f"config key 'optimizer.type': {self.type!r} is not supported yet by zero")
        if key not in OPTIMIZER_PARAMS:
            raise ConfigError(
                f"config key 'optimizer.type': got {self.type!r}; allowed: {', '.join(OPTIMIZER_NAMES)}"
                + nearest(self.type, OPTIMIZER_NAMES)
            )
        try:
            params = OPTIMIZER_PARAMS[key].model_validate(self.params)
        except pydantic.ValidationError as e:
            raise ConfigError(format_validation_error(e, OPTIMIZER_PARAMS[key], "optimizer.params")) from None
        if key == "adamw" and "adam_w_mode" in self.params and not self.params["adam_w_mode"]:
            raise ConfigError("config key 'optimizer.params.adam_w_mode': false contradicts type AdamW; use type Adam")
        if isinstance(params, AdamParams) and params.amsgrad and not params.torch_adam:
            raise NotSupportedError("config key 'optimizer.params.amsgrad': true needs 'torch_adam': true in zero")
        return params


class SchedulerSection(pydantic.BaseModel):
    """The `scheduler` section: ``{"type": "WarmupLR", "params": {...}}`` (type names are case-sensitive)."""

    model_config = _STRICT
    type: str
    params: dict = Field(default_factory=dict)

    def typed_params(self) -> pydantic.BaseModel:
        """The params validated for this type. Raises ConfigError / NotSupportedError naming the key."""
        if self.type in DEEPSPEED_ONLY_SCHEDULERS:
            raise NotSupportedError(f"config key 'scheduler.type': {self.type!r} is not supported yet by zero")
        if self.type not in SCHEDULER_PARAMS:
            raise ConfigError(
                f"config key 'scheduler.type': got {self.type!r}; allowed: {', '.join(SCHEDULER_PARAMS)}"
                + nearest(self.type, SCHEDULER_PARAMS)
            )
        model = SCHEDULER_PARAMS[self.type]
        try:
            return model.model_validate(self.params)
        except pydantic.ValidationError as e:
            raise ConfigError(format_validation_error(e, model, "scheduler.params")) from None
