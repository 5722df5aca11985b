"""``deepspeed.runtime.activation_checkpointing``: ``checkpointing`` and ``offload_activations``."""

from zero.as_deepspeed.runtime.activation_checkpointing import checkpointing, offload_activations

__all__ = ["checkpointing", "offload_activations"]
