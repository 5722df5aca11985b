"""``deepspeed.checkpoint`` for ``import zero as deepspeed``: only ``checkpoint.utils`` (what Accelerate imports).

zero's checkpoints themselves are ``zero_core.checkpoint``; activation checkpointing is ``zero.checkpointing``.
"""

from zero.checkpoint import utils

__all__ = ["utils"]
