"""``deepspeed.comm``: DeepSpeed's communication functions (``zero.collectives``, ``zero.point_to_point``,
``zero.process_groups``).

Signatures and defaults mirror DeepSpeed 0.19.8 (``deepspeed/comm/comm.py``); ``group=None`` means the default
(WORLD) group."""

from zero.collectives import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    reduce,
    reduce_scatter_tensor,
)
from zero.compat import unsupported_getattr
from zero.point_to_point import irecv, isend, recv, send
from zero.process_groups import (
    destroy_process_group,
    get_global_rank,
    get_local_rank,
    get_rank,
    get_world_group,
    get_world_size,
    init_distributed,
    is_available,
    is_initialized,
    new_group,
)

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "init_distributed",
    "irecv",
    "isend",
    "is_available",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "send",
    "ReduceOp",
]

__getattr__ = unsupported_getattr(
    "deepspeed.comm",
    {
        "monitored_barrier": "not implemented; use zero.comm.barrier (gloo waits are bounded by the group's timeout)",
        "gather": "not implemented; use zero.comm.all_gather",
        "scatter": "not implemented; use zero.comm.broadcast",
        "all_to_all": "lists of tensors are not implemented; use zero.comm.all_to_all_single (equal splits)",
        "inference_all_reduce": "inference is not implemented by zero; use zero.comm.all_reduce",
        "log_summary": "not served; use engine.comms_summary() with comms_logger.enabled in the config",
        "configure": "not served; use the config's comms_logger section",
    },
)
