"""``deepspeed.runtime``: what scripts and integrations import from it (``runtime.zero`` and its memory
estimators, ``lr_schedules``, ``engine.DeepSpeedEngine``, ``utils``, ``sequence_parallel.ulysses_sp``,
``activation_checkpointing``)."""

from zero.as_deepspeed.runtime import activation_checkpointing, engine, lr_schedules, sequence_parallel, utils, zero
from zero.compat import unsupported_getattr

__all__ = ["activation_checkpointing", "engine", "lr_schedules", "sequence_parallel", "utils", "zero"]

__getattr__ = unsupported_getattr(
    "deepspeed.runtime",
    {
        "pipe": "pipeline parallelism is not implemented; train the whole model with ZeRO stages 1-3",
    },
)
