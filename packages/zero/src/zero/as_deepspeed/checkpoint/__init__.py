"""``deepspeed.checkpoint``: only ``checkpoint.utils`` (what Accelerate imports).

zero's checkpoint format is ``zero_core.checkpoint``; activation checkpointing is ``deepspeed.checkpointing``."""

from zero.as_deepspeed.checkpoint import utils

__all__ = ["utils"]
