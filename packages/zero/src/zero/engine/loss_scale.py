"""The loss scaler's state under DeepSpeed 0.19.8's names, on the engine and on ``engine.optimizer``.

DeepSpeed's ZeRO optimizers (``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``) expose ``cur_scale``
and ``loss_scale`` (the current scale, settable), ``dynamic_loss_scale``, ``overflow`` (the last boundary's
verdict, the same on every rank) and ``loss_scaler`` (``cur_iter``, ``last_overflow_iter``, ``scale_window``,
``cur_hysteresis``, ``consecutive_hysteresis``, ``min_scale``, ``scale_factor``, ``delayed_shift``, ``dynamic``).
zero's ``engine.optimizer`` is the torch optimizer the runtime steps; :func:`expose_loss_scale` gives that object
these names (its class gains :class:`LossScaleNames`; ``isinstance`` and ``type(...).__name__`` are unchanged),
read live from the runtime's scaler. The engine's own DeepSpeed methods (config views) are
:class:`EngineLossScaleMixin`'s.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch


class ScaleSource(Protocol):
    """What the names read: the runtime's ``loss_scaler`` (``DynamicLossScaler`` / ``StaticLossScaler``) and the
    all-rank ``overflow`` verdict of its last step."""

    loss_scaler: object
    overflow: bool


class LossScaleNames:
    """DeepSpeed's loss-scale names on an optimizer, read from ``_zero_scale_source`` (a :class:`ScaleSource`)."""

    _zero_scale_source: ScaleSource

    @property
    def cur_scale(self) -> float:
        """The current loss scale (float); setting it sets the scaler's scale, as DeepSpeed."""
        return self._zero_scale_source.loss_scaler.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._zero_scale_source.loss_scaler.scale = float(value)

    loss_scale = cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when the scale moves with overflows (fp16 with ``loss_scale: 0``)."""
        return self._zero_scale_source.loss_scaler.dynamic

    @property
    def overflow(self) -> bool:
        """True when the last optimizer boundary saw a non-finite gradient on any rank (the step was skipped)."""
        return self._zero_scale_source.overflow

    @property
    def loss_scaler(self):
        """The scaler itself: DeepSpeed's ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_window``,
        ``cur_hysteresis``, ``consecutive_hysteresis``, ``min_scale``, ``scale_factor``, ``dynamic``."""
        return self._zero_scale_source.loss_scaler


@functools.cache
def _with_names(cls: type) -> type:
    from zero.engine.optimizer_names import ZeroOptimizerNames  # optimizer, refresh_fp32_params, offload_states

    bases = (cls, LossScaleNames, ZeroOptimizerNames)
    return type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def expose_loss_scale(optimizer: torch.optim.Optimizer, source: ScaleSource) -> None:
    """Give ``optimizer`` DeepSpeed's loss-scale names (:class:`LossScaleNames`), read live from ``source``."""
    if not isinstance(optimizer, LossScaleNames):
        optimizer.__class__ = _with_names(type(optimizer))
    optimizer._zero_scale_source = source


class EngineLossScaleMixin:
    """DeepSpeed engine methods about the fp16 loss scale (config views and the last step's outcome)."""

    def loss_scale(self) -> float:
        """The config's ``fp16.loss_scale``: 0 means dynamic (DeepSpeed's ``engine.loss_scale()``)."""
        return float(self.config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        """True when ``fp16.loss_scale`` is 0 (dynamic scaling)."""
        return self.loss_scale() == 0

    def initial_dynamic_scale(self) -> float:
        """``2 ** fp16.initial_scale_power``."""
        return 2**self.config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict:
        """DeepSpeed's dict: ``init_scale``, ``scale_window``, ``delayed_shift`` (hysteresis),
        ``consecutive_hysteresis``, ``min_scale``."""
        f = self.config.fp16
        return {"init_scale": 2**f.initial_scale_power, "scale_window": f.loss_scale_window,
                "delayed_shift": f.hysteresis, "consecutive_hysteresis": f.consecutive_hysteresis,
                "min_scale": f.min_loss_scale}  # fmt: skip

    def was_step_applied(self) -> bool:
        """True when the last ``step()`` updated the parameters (a boundary whose gradients were finite)."""
        return self._step_applied
