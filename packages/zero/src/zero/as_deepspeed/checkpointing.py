"""``deepspeed.checkpointing``: activation checkpointing (``zero.activation_checkpointing.api``).

The settings ``configure`` makes live in that module (``zero.activation_checkpointing.api.settings``)."""

from zero.activation_checkpointing.api import CheckpointFunction, checkpoint, configure, is_configured, reset, timings

__all__ = ["checkpoint", "CheckpointFunction", "configure", "is_configured", "reset", "timings"]
