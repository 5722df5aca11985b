"""``deepspeed.runtime.sequence_parallel``: ``ulysses_sp``."""

from zero.as_deepspeed.runtime.sequence_parallel import ulysses_sp

__all__ = ["ulysses_sp"]
