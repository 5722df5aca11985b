"""DeepSpeed 0.19.8's ZeRO optimizer classes as ``isinstance`` checks over zero's objects.

RLHF frameworks and DeepSpeed's own helpers import ``DeepSpeedZeroOptimizer`` (``runtime.zero.stage_1_and_2``),
``DeepSpeedZeroOptimizer_Stage3`` (``runtime.zero.stage3``) and ``DeepSpeedZeRoOffload``
(``runtime.zero.parameter_offload``) at load time and test ``engine.optimizer`` against them. zero's
``engine.optimizer`` is the torch optimizer the runtime steps (with DeepSpeed's names added, see
:mod:`zero.engine.loss_scale`), so these classes are checks, not bases: ``isinstance(engine.optimizer,
DeepSpeedZeroOptimizer_Stage3)`` is True for an engine at ZeRO stage 3, ``DeepSpeedZeroOptimizer`` at stages 1-2;
``DeepSpeedZeRoOffload`` matches stage 3's ``optimizer.parameter_offload``. Building one directly raises
NotSupportedError (``initialize()`` builds the engine's). Also ``get_mapping_to_flat_buffer``
(``runtime.zero.utils``).
"""

from __future__ import annotations

import torch

from zero.config import NotSupportedError


class _Check(type):
    """Metaclass: ``isinstance(obj, cls)`` asks ``cls._matches(obj)``."""

    def __instancecheck__(cls, obj) -> bool:
        return cls._matches(obj)


def _stage(obj) -> int | None:
    from zero.engine.loss_scale import LossScaleNames

    if not isinstance(obj, LossScaleNames):  # the optimizer of a zero engine
        return None
    return obj._zero_scale_source.stage


class _ZeroOptimizerCheck(metaclass=_Check):
    _stages: tuple[int, ...] = ()

    def __init__(self, *args, **kwargs):
        raise NotSupportedError(f"{type(self).__name__} is DeepSpeed's internal optimizer wrapper; zero builds the "
                                "engine's optimizer in initialize() (engine.optimizer)")  # fmt: skip

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage(obj) in cls._stages


class DeepSpeedZeroOptimizer(_ZeroOptimizerCheck):
    """``isinstance`` check: the optimizer of a zero engine at ZeRO stage 1 or 2 (DeepSpeed's ZeRO-1/2 wrapper)."""

    _stages = (1, 2)


class DeepSpeedZeroOptimizer_Stage3(_ZeroOptimizerCheck):  # noqa: N801  (DeepSpeed's name)
    """``isinstance`` check: the optimizer of a zero engine at ZeRO stage 3 (DeepSpeed's ZeRO-3 wrapper)."""

    _stages = (3,)


class DeepSpeedZeRoOffload(_ZeroOptimizerCheck):
    """``isinstance`` check: stage 3's ``optimizer.parameter_offload`` (DeepSpeed's parameter coordinator)."""

    @classmethod
    def _matches(cls, obj) -> bool:
        from zero.engine.param_offload_view import ParameterOffloadView

        return type.__instancecheck__(ParameterOffloadView, obj)


def get_mapping_to_flat_buffer(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """``(tensor, offset, numel)`` of each tensor laid end to end in one flat buffer, as DeepSpeed's helper."""
    out, offset = [], 0
    for t in tensors:
        out.append((t, offset, t.numel()))
        offset += t.numel()
    return out
