"""``deepspeed.launcher``: ``runner``'s constants (launching itself is ``zero run``)."""

from zero.as_deepspeed.launcher import runner

__all__ = ["runner"]
