"""The parallel groups (data, sequence, tensor) DeepSpeed's integrations ask for, answered for zero's world (served as
``deepspeed.utils.groups``).

Without an ``mpu`` the data-parallel group is the whole world (``torch.distributed.group.WORLD``) and sequence,
model and tensor parallelism have one rank each, as DeepSpeed 0.19.8 answers when no ``mpu`` or mesh was given.
After ``initialize(mpu=...)`` with a sequence-parallel mpu (Ulysses) the data, sequence and sequence-data-parallel
answers are the mpu's, as DeepSpeed's engine makes them by setting ``groups.mpu``.
After ``initialize`` with ``tensor_parallel.autotp_size`` > 1 the tensor-parallel getters
(``get_tensor_model_parallel_group/world_size/rank/src_rank``, ``get_model_parallel_*``) answer for the AutoTP mesh
and the data-parallel ones for the ranks holding the same shard, as DeepSpeed's ``_init_tp_mesh_device`` makes them;
without tensor parallelism the tensor-parallel group getters raise AssertionError, as DeepSpeed's do.
Names and return types mirror ``deepspeed/utils/groups.py``; every function needs a process group
(``zero.init_distributed()``) and raises RuntimeError naming itself without one. Expert parallelism and creating
model-parallel groups by hand raise ``NotSupportedError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

mpu = None
"""The sequence-parallel ``mpu`` the last ``initialize(mpu=...)`` was given (DeepSpeed's ``groups.mpu``); the
engine's ``destroy()`` clears it. None: data parallelism over the whole world."""


@dataclass(frozen=True)
class TensorParallelGroups:
    """The AutoTP mesh's two groups: ``tensor`` (ranks splitting one model replica) and ``data`` (ranks holding the
    same shard, what ZeRO partitions over); ``torch.distributed.ProcessGroup`` both."""

    tensor: object
    data: object


tensor_parallel: TensorParallelGroups | None = None
"""The groups of the last ``initialize`` with ``tensor_parallel.autotp_size`` > 1 (DeepSpeed's
``_TENSOR_MODEL_PARALLEL_GROUP`` / ``_DATA_PARALLEL_GROUP``); the engine's ``destroy()`` clears it."""

_tp_world_size: int | None = None  # set_tensor_model_parallel_world_size / _rank (DeepSpeed's _MPU_* overrides)
_tp_rank: int | None = None


def _world(name: str):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"deepspeed.utils.groups.{name}(): no process group; call zero.init_distributed() first")
    return dist.group.WORLD


def _dp(name: str):
    world = _world(name)
    if tensor_parallel is not None:
        return tensor_parallel.data
    return world if mpu is None else mpu.get_data_parallel_group()


def _sdp(name: str):
    world = _world(name)
    if tensor_parallel is not None:
        return tensor_parallel.data
    return world if mpu is None else mpu.get_sequence_data_parallel_group()


def _tp(name: str):
    _world(name)
    if tensor_parallel is None:
        raise AssertionError(f"deepspeed.utils.groups.{name}(): the tensor model parallel group is not initialized "
                             "(initialize() with tensor_parallel.autotp_size > 1 creates it)")  # fmt: skip
    return tensor_parallel.tensor


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
    if mpu is None and tensor_parallel is None:
        return range(dist.get_world_size(group))
    return dist.get_process_group_ranks(group)


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
    """Model-parallel ranks: the tensor-parallel size under AutoTP, else 1 (DeepSpeed's answer without an mpu or
    for an sp mpu)."""
    return 1 if tensor_parallel is None else get_tensor_model_parallel_world_size()


def get_tensor_model_parallel_group():
    """The tensor-parallel group this rank belongs to (consecutive global ranks ``r // autotp_size``).

    Raises:
        AssertionError: no engine with ``tensor_parallel.autotp_size`` > 1 exists (DeepSpeed's assertion).
    """
    return _tp("get_tensor_model_parallel_group")


def get_model_parallel_group():
    """The model-parallel group: the tensor-parallel group (DeepSpeed's, in 2-D dp x tp)."""
    return _tp("get_model_parallel_group")


def set_tensor_model_parallel_world_size(world_size: int) -> None:
    """Override what :func:`get_tensor_model_parallel_world_size` answers (None: the group's size again)."""
    global _tp_world_size
    _tp_world_size = world_size


def get_tensor_model_parallel_world_size() -> int:
    """Ranks of the tensor-parallel group (``autotp_size``), or the value set by
    :func:`set_tensor_model_parallel_world_size`."""
    if _tp_world_size is not None:
        return _tp_world_size
    return dist.get_world_size(_tp("get_tensor_model_parallel_world_size"))


def get_model_parallel_world_size() -> int:
    """Public name of :func:`get_tensor_model_parallel_world_size`."""
    return get_tensor_model_parallel_world_size()


def set_tensor_model_parallel_rank(rank: int) -> None:
    """Override what :func:`get_tensor_model_parallel_rank` answers (None: the group's rank again)."""
    global _tp_rank
    _tp_rank = rank


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in its tensor-parallel group (which shard of each split layer it holds), or the value set by
    :func:`set_tensor_model_parallel_rank`."""
    if _tp_rank is not None:
        return _tp_rank
    return dist.get_rank(_tp("get_tensor_model_parallel_rank"))


def get_model_parallel_rank() -> int:
    """Public name of :func:`get_tensor_model_parallel_rank`."""
    return get_tensor_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of this rank's tensor-parallel group's first rank (``(rank // tp) * tp``, DeepSpeed's formula)."""
    size = get_tensor_model_parallel_world_size()
    return (dist.get_rank() // size) * size


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
