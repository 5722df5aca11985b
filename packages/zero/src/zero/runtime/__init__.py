"""``deepspeed.runtime`` for ``import zero as deepspeed``: only what scripts and integrations import from it
(``runtime.zero`` and its memory estimators, ``runtime.lr_schedules``)."""

from zero.runtime import lr_schedules, zero

__all__ = ["lr_schedules", "zero"]
