"""Precision policy (three dtypes kept apart) and DeepSpeed-style loss scalers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each role uses, like FSDP2's ``MixedPrecisionPolicy`` and DeepSpeed's ``communication_data_type``.

    Attributes:
        param_dtype: storage of parameter shards and the dtype of parameter all-gathers (bytes moved).
        compute_dtype: the dtype the forward sees (the gathered parameters' dtype). None: ``param_dtype``. On CPUs
            without bf16 matrix units use bf16 ``param_dtype`` with fp32 ``compute_dtype`` (bf16 matmul was ~100x
            slower than fp32 on the reference machine).
        reduce_dtype: dtype of gradient all-reduce / reduce-scatter. None: ``compute_dtype``.
        master_dtype: dtype of the master weights the optimizer steps (fp32).
        grad_accum_dtype: dtype gradients accumulate in across micro-batches (the optimizer's ``.grad``). None:
            ``master_dtype`` (fp32 accumulation, DeepSpeed's ``grad_accum_dtype=fp32``); set it to ``reduce_dtype``
            to save memory.

    Raises:
        ValueError: a field is not a floating dtype (names the field and the value).
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "compute_dtype", "reduce_dtype", "master_dtype", "grad_accum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOATS:
                raise ValueError(f"PrecisionPolicy.{name} must be one of {_FLOATS}, got {value!r}")

    @property
    def compute(self) -> torch.dtype:
        """Resolved compute dtype."""
        return self.compute_dtype or self.param_dtype

    @property
    def reduce(self) -> torch.dtype:
        """Resolved reduction dtype."""
        return self.reduce_dtype or self.compute

    @property
    def accum(self) -> torch.dtype:
        """Resolved gradient accumulation dtype."""
        return self.grad_accum_dtype or self.master_dtype

    @classmethod
    def fp32(cls) -> PrecisionPolicy:
        """Everything fp32."""
        return cls()

    @classmethod
    def bf16(cls, compute_dtype: torch.dtype = torch.float32) -> PrecisionPolicy:
        """bf16 storage and communication, fp32 master and accumulation, ``compute_dtype`` forward (fp32 on CPU)."""
        return cls(param_dtype=torch.bfloat16, compute_dtype=compute_dtype, reduce_dtype=torch.bfloat16)

    @classmethod
    def fp16(cls) -> PrecisionPolicy:
        """fp16 storage, compute and communication, fp32 master and accumulation (use with a DynamicLossScaler)."""
        return cls(param_dtype=torch.float16)


class LossScaler(Protocol):
    """What ``ZeroRuntime`` uses of a loss scaler (:class:`DynamicLossScaler`, :class:`StaticLossScaler`)."""

    scale: float
    """The factor the loss is multiplied by before backward (gradients are divided by it before the step)."""
    dynamic: bool
    """The scale moves with overflows. False: ``update(False)`` does nothing, and the runtime calls ``update`` only
    after an overflow."""

    def update(self, overflow: bool) -> None:
        """Advance one step after the (all-rank) overflow decision."""
        ...


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling for fp16 with DeepSpeed's semantics (``initial_scale_power``, ``loss_scale_window``,
    ``hysteresis``, ``min_loss_scale``; behaviour of ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``).

    On an overflow: if the hysteresis budget is exhausted (counter at 1) the scale is divided by ``scale_factor``
    (not below ``min_scale``), else the counter decreases; the overflow iteration is remembered. Without overflow:
    the scale is multiplied by ``scale_factor`` (and the hysteresis counter restored) when the good iterations
    before this one since the last overflow are a positive multiple of ``scale_window``, so the first growth comes
    on the ``scale_window + 1``-th good step (DeepSpeed's ``stable_interval``); with ``consecutive_hysteresis``
    the counter is restored after every good step.

    Attributes: ``scale`` (float), ``cur_iter``, ``last_overflow_iter``, ``cur_hysteresis``, ``skipped_steps``;
    DeepSpeed's names ``cur_scale`` (= ``scale``), ``delayed_shift`` (= ``hysteresis``), ``dynamic`` (True).
    """

    dynamic: ClassVar[bool] = True
    """The scale moves with overflows (DeepSpeed's ``loss_scaler.dynamic``): ``update`` runs after every step."""

    init_scale: float = 2.0**16
    scale_window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    scale_factor: float = 2.0
    consecutive_hysteresis: bool = False
    scale: float = field(init=False)
    cur_iter: int = field(init=False, default=0)
    last_overflow_iter: int = field(init=False, default=-1)
    cur_hysteresis: int = field(init=False)
    skipped_steps: int = field(init=False, default=0)

    def __post_init__(self):
        if self.init_scale <= 0 or self.scale_window < 1 or self.hysteresis < 1 or self.min_scale <= 0:
            raise ValueError(
                f"DynamicLossScaler: need init_scale > 0, scale_window >= 1, hysteresis >= 1, min_scale > 0; got "
                f"{self.init_scale}, {self.scale_window}, {self.hysteresis}, {self.min_scale}"
            )
        self.scale = float(self.init_scale)
        self.cur_hysteresis = self.hysteresis

    @classmethod
    def from_deepspeed(
        cls, initial_scale_power: int = 16, loss_scale_window: int = 1000, hysteresis: int = 2, min_loss_scale=1.0
    ) -> DynamicLossScaler:
        """Build from the DeepSpeed ``fp16`` section's key names."""
        return cls(2.0**initial_scale_power, loss_scale_window, hysteresis, float(min_loss_scale))

    def update(self, overflow: bool) -> None:
        """Advance one iteration after the (all-rank) overflow decision."""
        if overflow:
            if self.cur_hysteresis <= 1:
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            self.skipped_steps += 1
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name of :attr:`scale` (settable)."""
        return self.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scale = float(value)

    @property
    def delayed_shift(self) -> int:
        """DeepSpeed's name of :attr:`hysteresis`."""
        return self.hysteresis

    def state_dict(self) -> dict:
        """Everything needed to resume the scale trajectory exactly."""
        keys = ("scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "skipped_steps")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`."""
        for k, v in state.items():
            setattr(self, k, v)


@dataclass
class StaticLossScaler:
    """A fixed scale (1.0 for fp32/bf16). Non-finite gradients still skip the step and are counted."""

    dynamic: ClassVar[bool] = False
    """The scale is fixed (DeepSpeed's ``loss_scaler.dynamic``): ``update(False)`` does nothing, so the runtime
    calls ``update`` only after an overflow."""

    scale: float = 1.0
    skipped_steps: int = 0

    @property
    def cur_scale(self) -> float:
        """DeepSpeed's name of :attr:`scale` (settable)."""
        return self.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.scale = float(value)

    def update(self, overflow: bool) -> None:
        """Count skipped steps; the scale never changes."""
        self.skipped_steps += int(overflow)

    def state_dict(self) -> dict:
        """The scale and the skip count."""
        return {"scale": self.scale, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`."""
        self.scale, self.skipped_steps = state["scale"], state["skipped_steps"]
