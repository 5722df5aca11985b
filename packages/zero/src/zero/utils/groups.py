"""``deepspeed.utils.groups``: the process groups DeepSpeed's integrations ask for, answered for zero's world.

zero has data parallelism only: the data-parallel group is the whole world (``torch.distributed.group.WORLD``),
sequence, model and tensor parallelism have one rank each, as DeepSpeed 0.19.8 answers when no ``mpu`` or mesh
was given. Names and return types mirror ``deepspeed/utils/groups.py``; every function needs a process group
(``zero.init_distributed()``) and raises RuntimeError naming itself without one. Expert and tensor-parallel set-up
raise ``NotSupportedError``.
"""

from __future__ import annotations

import torch.distributed as dist

from zero.compat import unsupported_getattr


def _world(name: str):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"deepspeed.utils.groups.{name}(): no process group; call zero.init_distributed() first")
    return dist.group.WORLD


def _get_data_parallel_group():
    """The data-parallel process group: the whole world."""
    return _world("_get_data_parallel_group")


def _get_data_parallel_world_size() -> int:
    """Ranks in the data-parallel group: the world size."""
    return dist.get_world_size(_world("_get_data_parallel_world_size"))


def _get_data_parallel_rank() -> int:
    """This rank's index in the data-parallel group: its global rank."""
    return dist.get_rank(_world("_get_data_parallel_rank"))


def _get_data_parallel_group_ranks() -> range:
    """Global ranks of the data-parallel group: ``range(world_size)``."""
    return range(dist.get_world_size(_world("_get_data_parallel_group_ranks")))


def get_data_parallel_group():
    """Public name of :func:`_get_data_parallel_group`."""
    return _world("get_data_parallel_group")


def get_data_parallel_world_size() -> int:
    """Public name of :func:`_get_data_parallel_world_size`."""
    return dist.get_world_size(_world("get_data_parallel_world_size"))


def get_data_parallel_rank() -> int:
    """Public name of :func:`_get_data_parallel_rank`."""
    return dist.get_rank(_world("get_data_parallel_rank"))


def _get_broadcast_src_rank() -> int:
    """Global rank that broadcasts to the (sequence-)data-parallel group: 0."""
    _world("_get_broadcast_src_rank")
    return 0


def _get_model_parallel_world_size() -> int:
    """Model-parallel ranks: 1 (no model parallelism; DeepSpeed's answer without an ``mpu``)."""
    return 1


def _get_sequence_parallel_world_size() -> int:
    """Sequence-parallel ranks: 1 (no sequence parallelism)."""
    _world("_get_sequence_parallel_world_size")
    return 1


def _get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group: 0."""
    return 0


def _get_sequence_parallel_group():
    """There is no sequence-parallel group: raises KeyError, as DeepSpeed does without an ``mpu`` or mesh."""
    raise KeyError("No sequence parallel group found: zero has no sequence parallelism (Ulysses); "
                   "sequence_parallel_size must be 1")  # fmt: skip


def _get_sequence_data_parallel_world_size() -> int:
    """Ranks of the sequence x data-parallel group: the data-parallel world size (sequence parallelism is 1)."""
    return dist.get_world_size(_world("_get_sequence_data_parallel_world_size"))


def _get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence x data-parallel group: its global rank."""
    return dist.get_rank(_world("_get_sequence_data_parallel_rank"))


def _get_sequence_data_parallel_group():
    """The sequence x data-parallel group: the whole world."""
    return _world("_get_sequence_data_parallel_group")


_NO_EXPERTS = "expert parallelism is not implemented; train MoE models with ZeRO stages 1-3 (experts are sharded)"
_NO_TP = "tensor/model parallelism is not implemented; zero has data parallelism (ZeRO) only"
__getattr__ = unsupported_getattr(
    "deepspeed.utils.groups",
    {
        "initialize": _NO_EXPERTS,
        "_create_expert_and_data_parallel": _NO_EXPERTS,
        "_get_expert_parallel_group": _NO_EXPERTS,
        "_get_expert_data_parallel_group": _NO_EXPERTS,
        "_get_expert_parallel_world_size": _NO_EXPERTS,
        "_get_expert_parallel_rank": _NO_EXPERTS,
        "_get_max_expert_size": _NO_EXPERTS,
        "_create_model_parallel": _NO_TP,
        "_init_tp_mesh_device": _NO_TP,
        "get_tensor_model_parallel_group": _NO_TP,
        "get_model_parallel_group": _NO_TP,
    },
)
