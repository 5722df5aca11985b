"""``deepspeed.runtime.activation_checkpointing.offload_activations``: checkpointed hidden states kept in host memory
(``zero.activation_checkpointing.offload``)."""

from zero.activation_checkpointing.offload import (
    CheckpointActivationOffloadStats,
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
]
