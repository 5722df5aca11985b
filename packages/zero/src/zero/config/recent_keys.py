"""Top-level keys DeepSpeed 0.19.x-0.20 added, with DeepSpeed's meaning (``deepspeed/runtime/config.py``), mixed
into :class:`zero.config.EngineConfig`; :func:`check_recent_keys` refuses what DeepSpeed refuses and what zero does
not implement."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field

from zero.config.errors import ConfigError, NotSupportedError

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class RecentTopLevelKeys(pydantic.BaseModel):
    """``gradient_allreduce_op``, ``log_level``, ``managed_gradient_accumulation``,
    ``use_data_before_expert_parallelism`` (strings case-insensitive, as DeepSpeed lowercases them)."""

    gradient_allreduce_op: Literal["mean", "sum"] = Field(
        "mean", description="How data-parallel gradients combine: 'mean' averages them; 'sum' adds them (the "
        "engine's backward scales the loss by the data-parallel size, which the averaging reduction undoes), at "
        "stages 0-2 and without zenflow or DeepCompile, as DeepSpeed allows it.")  # fmt: skip
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = Field(
        None, description="Level of zero's logger ('zero'; DeepSpeed sets its own 'DeepSpeed' logger), set by "
        "initialize(); None leaves it.")  # fmt: skip
    managed_gradient_accumulation: bool = Field(
        True, description="True: the engine decides the accumulation boundary from gradient_accumulation_steps "
        "(zero's behaviour); false (every step() a boundary) is refused (check_recent_keys).")  # fmt: skip
    use_data_before_expert_parallelism: bool = Field(
        False, description="Order of DeepSpeed's expert and data parallel groups for the MoE layers' ep_size: "
        "false: expert-parallel groups are consecutive ranks (E + D); true: expert-data-parallel groups are "
        "(D + E).")  # fmt: skip

    # initialize() was given an optimizer (DeepSpeed's client_optimizer), which wins over the `optimizer` section
    _client_optimizer: bool = pydantic.PrivateAttr(default=False)

    @property
    def client_optimizer_given(self) -> bool:
        """True when ``initialize`` was given the optimizer (DeepSpeed's ``engine.client_optimizer`` is set)."""
        return self._client_optimizer

    @pydantic.field_validator("gradient_allreduce_op", "log_level", mode="before")
    @classmethod
    def _lower(cls, value):
        return value.lower() if isinstance(value, str) else value


def check_recent_keys(cfg) -> None:
    """For an ``EngineConfig``: ConfigError for ``gradient_allreduce_op: "sum"`` where DeepSpeed refuses it (ZeRO
    stage 3, zenflow, DeepCompile); NotSupportedError naming the key for ``managed_gradient_accumulation: false``,
    whose meaning zero does not implement."""
    if cfg.gradient_allreduce_op == "sum":
        with_what = ("ZeRO stage 3" if cfg.zero_optimization.stage == 3 else
                     "zero_optimization.zenflow" if cfg.zero_optimization.zenflow is not None else
                     "compile.deepcompile" if cfg.compile.deepcompile else None)  # fmt: skip
        if with_what is not None:
            raise ConfigError(f"config key 'gradient_allreduce_op': 'sum' is not supported with {with_what} "
                              "(DeepSpeed refuses it too); use 'mean'")  # fmt: skip
    if not cfg.managed_gradient_accumulation:
        raise NotSupportedError("config key 'managed_gradient_accumulation': false (every step() a boundary) is not "
                                "supported by zero; keep it true and set gradient_accumulation_steps, or force the "
                                "boundary with engine.set_gradient_accumulation_boundary()")  # fmt: skip
