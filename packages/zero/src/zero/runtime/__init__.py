"""``deepspeed.runtime`` for ``import zero as deepspeed``: only what scripts and integrations import from it
(``runtime.zero`` and its memory estimators, ``runtime.lr_schedules``, ``runtime.engine.DeepSpeedEngine``,
``runtime.utils``, ``runtime.sequence_parallel.ulysses_sp``,
``runtime.activation_checkpointing.offload_activations``)."""

from zero.compat import unsupported_getattr
from zero.runtime import activation_checkpointing, engine, lr_schedules, sequence_parallel, utils, zero

__all__ = ["activation_checkpointing", "engine", "lr_schedules", "sequence_parallel", "utils", "zero"]

__getattr__ = unsupported_getattr(
    "deepspeed.runtime",
    {
        "pipe": "pipeline parallelism is not implemented; train the whole model with ZeRO stages 1-3",
    },
)
