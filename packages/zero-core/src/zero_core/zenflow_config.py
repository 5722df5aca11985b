"""``ZenFlowConfig``: the ``zero_optimization.zenflow`` section (DeepSpeed 0.18+'s ZenFlow), validated.

ZenFlow (Lan et al. 2025, arXiv 2505.12242) is ZeRO-Offload where the most important gradient columns of each
weight matrix (the largest sums of |gradient| over a column) are stepped on the device every optimizer step,
while the host accumulates the gradients of the rest and steps them every ``update_interval`` steps, optionally
asynchronously (``overlap_step``: bounded staleness of one update interval). zero_offload implements it; this
module only validates the keys. Key names and defaults are DeepSpeed 0.19.8's ``ZenFlowConfig``; differences:
``topk_ratio`` 1.0 is accepted (every column on the device; DeepSpeed asks for < 1), and integer intervals and
counts must be integers (booleans and fractional numbers are refused, naming the field).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


def _integer(value: Any, *, minimum: int, auto: bool) -> Any:
    if auto and value == "auto":
        return value
    bad = isinstance(value, float) and (not math.isfinite(value) or value != int(value))
    if isinstance(value, bool) or not isinstance(value, int | float) or bad:
        allowed = '"auto" or an integer' if auto else "an integer"
        raise ValueError(f"must be {allowed} >= {minimum}, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"must be >= {minimum}, got {value!r}")
    return int(value)


AutoOrPositive = Annotated[Literal["auto"] | int, BeforeValidator(lambda v: _integer(v, minimum=1, auto=True))]
"""``"auto"`` or an integer >= 1 (integral floats accepted; booleans refused)."""
NonNegative = Annotated[int, BeforeValidator(lambda v: _integer(v, minimum=0, auto=False))]
Positive = Annotated[int, BeforeValidator(lambda v: _integer(v, minimum=1, auto=False))]


class ZenFlowConfig(BaseModel):
    """``zero_optimization.zenflow``; needs ``offload_optimizer.device`` ``"cpu"`` and stage 1 or 2 (checked by
    ``ZeroConfig``). Steps are optimizer steps (one per gradient accumulation boundary; DeepSpeed instead sets
    ``gradient_accumulation_steps`` to ``update_interval``, so the two agree when it is 1).

    Raises:
        pydantic.ValidationError: a value out of range or of the wrong type, an unknown key, or an inconsistent
            pair (named by field): ``select_strategy`` "auto" with an integer ``select_interval``; "step"/"epoch"
            with ``select_interval`` "auto"; a ``select_interval`` shorter than ``update_interval``.
    """

    model_config = ConfigDict(extra="forbid")

    topk_ratio: float = Field(0.1, gt=0.0, le=1.0, description="Fraction of each weight matrix's columns (the "
                              "most important by summed |gradient|) stepped on the device every step; 1-D "
                              "parameters (biases, norms) are always stepped there.")  # fmt: skip
    select_strategy: Literal["auto", "step", "epoch"] = Field("auto", description="Unit of select_interval: "
                                                              "'step', 'epoch' (steps_per_epoch steps), or 'auto' "
                                                              "(every epoch).")  # fmt: skip
    select_interval: AutoOrPositive = Field("auto", description="Columns are re-selected every this many steps "
                                            "(or epochs); 'auto' with select_strategy 'auto'.")  # fmt: skip
    update_interval: AutoOrPositive = Field("auto", description="The host steps the other columns every this many "
                                            "steps with their accumulated gradient; 'auto': when, for auto_ratio of "
                                            "the weight matrices, the accumulated gradient of the other columns "
                                            "per element reaches that of the selected ones in one step."
                                            )  # fmt: skip
    overlap_step: bool = Field(False, description="Run the host step in a worker thread while training goes on; its "
                               "result is applied at the next update boundary (staleness: one update interval)."
                               )  # fmt: skip
    offload: bool = Field(False, description="Keep the selected columns' Adam moments in host memory between "
                          "steps (device memory saved, two copies per step).")  # fmt: skip
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0, description="update_interval 'auto': the fraction of weight "
                              "matrices that must ask for an update.")  # fmt: skip
    full_warm_up_rounds: NonNegative = Field(0, description="The first this many steps update every element on the "
                                             "host every step (plain ZeRO-Offload).")  # fmt: skip
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0, description="overlap_step: share of the cores left "
                                          "to the training thread; the host step's worker gets the rest (>= 1)."
                                          )  # fmt: skip
    steps_per_epoch: Positive | None = Field(None, description="Steps per epoch for select_strategy 'epoch' / 'auto' "
                                             "(zero.initialize fills it from training_data, as DeepSpeed from its "
                                             "dataloader; without either, columns are selected once, after "
                                             "warm-up).")  # fmt: skip

    @model_validator(mode="after")
    def _consistent(self) -> ZenFlowConfig:
        if self.select_strategy == "auto" and self.select_interval != "auto":
            raise ValueError(f"select_interval={self.select_interval!r} needs select_strategy 'step' or 'epoch' "
                             "(with 'auto' columns are re-selected every epoch); set one of them")  # fmt: skip
        if self.select_strategy != "auto" and self.select_interval == "auto":
            raise ValueError(f"select_strategy={self.select_strategy!r} needs an integer select_interval (got "
                             "'auto'); set it, or select_strategy 'auto'")  # fmt: skip
        every = self.select_steps
        if every and isinstance(self.update_interval, int) and every < self.update_interval:
            raise ValueError(f"select_interval ({every} steps) must be >= update_interval ({self.update_interval}): "
                             "columns are re-selected only after their host update")  # fmt: skip
        return self

    @property
    def select_steps(self) -> int:
        """Steps between column selections after warm-up; 0: select once (an epoch strategy without
        ``steps_per_epoch``)."""
        if self.select_strategy == "step":
            return int(self.select_interval)
        per = 1 if self.select_interval == "auto" else int(self.select_interval)
        return per * self.steps_per_epoch if self.steps_per_epoch else 0
