"""``deepspeed.utils.groups``: the process groups DeepSpeed's integrations ask for, answered for zero's world.

Without an ``mpu`` the data-parallel group is the whole world (``torch.distributed.group.WORLD``) and sequence,
model and tensor parallelism have one rank each, as DeepSpeed 0.19.8 answers when no ``mpu`` or mesh was given.
After ``initialize(mpu=...)`` with a sequence-parallel mpu (Ulysses) the data, sequence and sequence-data-parallel
answers are the mpu's, as DeepSpeed's engine makes them by setting ``groups.mpu``.
Names and return types mirror ``deepspeed/utils/groups.py``; every function needs a process group
(``zero.init_distributed()``) and raises RuntimeError naming itself without one. Expert and tensor-parallel set-up
raise ``NotSupportedError``.
"""

from __future__ import annotations

import torch.distributed as dist

from zero.compat import unsupported_getattr

mpu = None
"""The sequence-parallel ``mpu`` the last ``initialize(mpu=...)`` was given (DeepSpeed's ``groups.mpu``); the
engine's ``destroy()`` clears it. None: data parallelism over the whole world."""


def _world(name: str):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"deepspeed.utils.groups.{name}(): no process group; call zero.init_distributed() first")
    return dist.group.WORLD


def _dp(name: str):
    world = _world(name)
    return world if mpu is None else mpu.get_data_parallel_group()


def _sdp(name: str):
    world = _world(name)
    return world if mpu is None else mpu.get_sequence_data_parallel_group()


def _get_data_parallel_group():
    """The data-parallel process group: the mpu's (same sequence shard, other samples), else the whole world."""
    return _dp("_get_data_parallel_group")


def _get_data_parallel_world_size() -> int:
    """Ranks in the data-parallel group: world size // sequence-parallel size."""
    return dist.get_world_size(_dp("_get_data_parallel_world_size"))


def _get_data_parallel_rank() -> int:
    """This rank's index in the data-parallel group (its global rank without an mpu)."""
    return dist.get_rank(_dp("_get_data_parallel_rank"))


def _get_data_parallel_group_ranks() -> range | list[int]:
    """Global ranks of the data-parallel group: ``range(world_size)`` without an mpu, else the mpu group's list."""
    group = _dp("_get_data_parallel_group_ranks")
    return range(dist.get_world_size(group)) if mpu is None else dist.get_process_group_ranks(group)


def get_data_parallel_group():
    """Public name of :func:`_get_data_parallel_group`."""
    return _dp("get_data_parallel_group")


def get_data_parallel_world_size() -> int:
    """Public name of :func:`_get_data_parallel_world_size`."""
    return dist.get_world_size(_dp("get_data_parallel_world_size"))


def get_data_parallel_rank() -> int:
    """Public name of :func:`_get_data_parallel_rank`."""
    return dist.get_rank(_dp("get_data_parallel_rank"))


def _get_broadcast_src_rank() -> int:
    """Global rank that broadcasts to the sequence-data-parallel group: its rank 0's global rank."""
    return dist.get_global_rank(_sdp("_get_broadcast_src_rank"), 0)


def _get_model_parallel_world_size() -> int:
    """Model-parallel ranks: 1 (no tensor parallelism; DeepSpeed's answer without an mpu or for an sp mpu)."""
    return 1


def _get_sequence_parallel_world_size() -> int:
    """Ranks sharing one sequence: the mpu's sequence-parallel size, 1 without an mpu."""
    _world("_get_sequence_parallel_world_size")
    return 1 if mpu is None else mpu.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    """This rank's index in its sequence-parallel group (which shard of each sequence it holds); 0 without one."""
    return 0 if mpu is None else mpu.get_sequence_parallel_rank()


def _get_sequence_parallel_group():
    """The mpu's sequence-parallel group; without an mpu raises KeyError, as DeepSpeed does."""
    if mpu is None:
        raise KeyError("No sequence parallel group found: no sequence-parallel mpu was given to initialize() "
                       "(UlyssesSPAttentionHF.register_with_transformers returns one)")  # fmt: skip
    return mpu.get_sequence_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    """Ranks of the sequence x data-parallel group (what ZeRO shards over): the world size."""
    return dist.get_world_size(_sdp("_get_sequence_data_parallel_world_size"))


def _get_sequence_data_parallel_rank() -> int:
    """This rank's index in the sequence x data-parallel group."""
    return dist.get_rank(_sdp("_get_sequence_data_parallel_rank"))


def _get_sequence_data_parallel_group():
    """The sequence x data-parallel group: the mpu's, else the data-parallel group (the whole world)."""
    return _sdp("_get_sequence_data_parallel_group")


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
