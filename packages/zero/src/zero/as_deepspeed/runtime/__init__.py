"""``deepspeed.runtime``: what scripts and integrations import from it (``runtime.zero`` and its memory
estimators, ``lr_schedules``, ``engine.DeepSpeedEngine``, ``utils``, ``sequence_parallel.ulysses_sp``,
``activation_checkpointing``, ``pipe``, ``hybrid_engine``)."""

from zero.as_deepspeed.runtime import (
    activation_checkpointing,
    engine,
    hybrid_engine,
    lr_schedules,
    pipe,
    sequence_parallel,
    utils,
    zero,
)

__all__ = [
    "activation_checkpointing",
    "engine",
    "hybrid_engine",
    "lr_schedules",
    "pipe",
    "sequence_parallel",
    "utils",
    "zero",
]
