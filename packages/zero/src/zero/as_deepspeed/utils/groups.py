"""``deepspeed.utils.groups``: the data, sequence and tensor-parallel groups (``zero.parallel_groups``; ``mpu``, the
one ``initialize`` was given, is read from there at each access) and the expert and expert-data-parallel groups
(``zero_parallel.moe.groups``)."""

from zero import parallel_groups as _state
from zero.compat import unsupported_getattr
from zero.parallel_groups import (
    TensorParallelGroups,
    _get_broadcast_src_rank,
    _get_data_parallel_group,
    _get_data_parallel_group_ranks,
    _get_data_parallel_rank,
    _get_data_parallel_world_size,
    _get_model_parallel_world_size,
    _get_sequence_data_parallel_group,
    _get_sequence_data_parallel_rank,
    _get_sequence_data_parallel_world_size,
    _get_sequence_parallel_group,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    set_tensor_model_parallel_rank,
    set_tensor_model_parallel_world_size,
)
from zero_parallel.moe.groups import (
    _create_expert_and_data_parallel,
    _get_expert_broadcast_src_rank,
    _get_expert_data_parallel_group,
    _get_expert_data_parallel_group_dict,
    _get_expert_data_parallel_group_ranks,
    _get_expert_data_parallel_rank,
    _get_expert_data_parallel_world_size,
    _get_expert_model_parallel_world_size,
    _get_expert_parallel_group,
    _get_expert_parallel_group_dict,
    _get_expert_parallel_group_ranks,
    _get_expert_parallel_rank,
    _get_expert_parallel_src_rank,
    _get_expert_parallel_world_size,
    _get_max_expert_parallel_group,
    _get_max_expert_size,
    _get_max_expert_size_name,
)

__all__ = [
    "_get_broadcast_src_rank",
    "get_data_parallel_group",
    "_get_data_parallel_group",
    "_get_data_parallel_group_ranks",
    "get_data_parallel_rank",
    "_get_data_parallel_rank",
    "get_data_parallel_world_size",
    "_get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "get_model_parallel_world_size",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
    "set_tensor_model_parallel_rank",
    "set_tensor_model_parallel_world_size",
    "TensorParallelGroups",
    "_create_expert_and_data_parallel",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_model_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_src_rank",
    "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
]

_DEPRECATED_INITIALIZE = (
    "groups.initialize() is deprecated in DeepSpeed too; pass ep_size to deepspeed.moe.layer.MoE(...)"
)
_NO_TP = (
    "creating model-parallel groups by hand is not supported; set tensor_parallel.autotp_size in the config "
    "and initialize() builds them (the getters then answer)"
)
__getattr__ = unsupported_getattr(
    "deepspeed.utils.groups",
    {
        "initialize": _DEPRECATED_INITIALIZE,
        "_create_model_parallel": _NO_TP,
        "_init_tp_mesh_device": _NO_TP,
    },
    live_from=_state,
    live=("mpu",),
)
