"""``deepspeed.runtime.activation_checkpointing.checkpointing``: the same functions as ``deepspeed.checkpointing``
(``zero.activation_checkpointing.api``)."""

from zero.activation_checkpointing.api import CheckpointFunction, checkpoint, configure, is_configured, reset, timings

__all__ = ["checkpoint", "CheckpointFunction", "configure", "is_configured", "reset", "timings"]
