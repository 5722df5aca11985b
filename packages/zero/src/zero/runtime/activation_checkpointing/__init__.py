"""``deepspeed.runtime.activation_checkpointing`` for ``import zero as deepspeed``: ``offload_activations``
(checkpointed hidden states kept in host memory, Arctic Long Sequence Training's offload). DeepSpeed's
``checkpointing`` module is served as ``deepspeed.checkpointing`` (``zero.checkpointing``)."""

from zero.runtime.activation_checkpointing import offload_activations

__all__ = ["offload_activations"]
