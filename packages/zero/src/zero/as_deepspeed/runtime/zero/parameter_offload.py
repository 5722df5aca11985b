"""``deepspeed.runtime.zero.parameter_offload``: ``DeepSpeedZeRoOffload`` (an ``isinstance`` check matching stage
3's ``optimizer.parameter_offload``: ``zero.engine.optimizer_kinds``)."""

from zero.engine.optimizer_kinds import DeepSpeedZeRoOffload

__all__ = ["DeepSpeedZeRoOffload"]
