"""``deepspeed.runtime`` for ``import zero as deepspeed``: only what scripts and integrations import from it
(``runtime.zero`` and its memory estimators, ``runtime.lr_schedules``, ``runtime.engine.DeepSpeedEngine``,
``runtime.utils``)."""

from zero.compat import unsupported_getattr
from zero.runtime import engine, lr_schedules, utils, zero

__all__ = ["engine", "lr_schedules", "utils", "zero"]

__getattr__ = unsupported_getattr(
    "deepspeed.runtime",
    {
        "sequence_parallel": "Ulysses sequence parallelism is not implemented; keep sequence_parallel_size at 1",
        "pipe": "pipeline parallelism is not implemented; train the whole model with ZeRO stages 1-3",
    },
)
