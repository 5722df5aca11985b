"""The process groups of several parallel dimensions, as named dimensions of one torch ``DeviceMesh``.

The mesh is (dp, sp, tp), tp varying fastest, then sp: rank ``r`` has tensor-parallel rank ``r % tp`` and
sequence-parallel rank ``(r // tp) % sp``, so each tensor-parallel group (and, with tp = 1, each sequence-parallel
group) is a run of consecutive ranks, as DeepSpeed lays out its tensor-parallel and ``parallel_state_sp`` groups.
Sequence and tensor parallelism are not combined yet: one of sp and tp is 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "sp", "tp")
"""The mesh's dimension names: data parallel, sequence parallel (Ulysses), tensor parallel (AutoTP)."""


def _check_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def init_parallel_mesh(sequence_parallel_size: int = 1, device_type: str | None = None,
                       tensor_parallel_size: int = 1) -> DeviceMesh:  # fmt: skip
    """A ``DeviceMesh`` over the whole default process group, dimensions ``("dp", "sp", "tp")``.

    Args:
        sequence_parallel_size: ranks that share one sequence (Ulysses); must divide the world size.
        device_type: the mesh's device type; default ``"cuda"`` when the default group is NCCL, else ``"cpu"``.
        tensor_parallel_size: ranks that hold the shards of one model replica (AutoTP); sp x tp must divide the
            world size, and one of the two must be 1.

    Returns:
        ``init_device_mesh(device_type, (world // (sp * tp), sp, tp), mesh_dim_names=MESH_DIMS)``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        TypeError / ValueError: a size is not an int >= 1, sp x tp does not divide the world size, or both sp and
            tp are above 1.
    """
    sp = _check_size("sequence_parallel_size", sequence_parallel_size)
    tp = _check_size("tensor_parallel_size", tensor_parallel_size)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("init_parallel_mesh needs torch.distributed initialized (init_process_group) first")
    if sp > 1 and tp > 1:
        raise ValueError(f"sequence_parallel_size={sp} with tensor_parallel_size={tp}: sequence and tensor "
                         "parallelism are not combined yet; set one of them to 1")  # fmt: skip
    world = dist.get_world_size()
    if world % (sp * tp):
        what = "sequence_parallel_size" if tp == 1 else "tensor_parallel_size"
        raise ValueError(
            f"{what}={sp * tp} does not divide the world size {world}: the world is laid out as "
            f"data-parallel x sequence-parallel x tensor-parallel, so world size must be a multiple of {what}"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // (sp * tp), sp, tp), mesh_dim_names=MESH_DIMS)


class SequenceParallelMPU:
    """DeepSpeed's ``mpu`` for sequence parallelism (``deepspeed.runtime.sequence_parallel.parallel_state_sp``),
    answered from a ``DeviceMesh`` of dimensions :data:`MESH_DIMS`.

    Groups (each a ``torch.distributed.ProcessGroup``; world sizes and ranks are ints):

    * sequence parallel (``get_sequence_parallel_*``): the ranks that share one sequence, each holding a shard
      of it; the Ulysses all-to-alls run here.
    * data parallel (``get_data_parallel_*``): the ranks that hold the same sequence shard of different samples
      (the mesh's ``dp`` dimension).
    * sequence-data parallel (``get_sequence_data_parallel_*``): sp x dp, the whole mesh. The parameters are
      replicated over it, so ZeRO shards and reduces over this group (as DeepSpeed does for an sp mpu).
    * model parallel (``get_model_parallel_*``): the mesh's ``tp`` dimension, of size 1: parameters are not split.
      DeepSpeed's ``groups`` module likewise answers model-parallel world size 1 for an sp mpu.

    Raises (``__init__``): ValueError when the mesh's dimension names are not :data:`MESH_DIMS`.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        if tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
            raise ValueError(f"mesh must have dimensions {MESH_DIMS}, got {mesh.mesh_dim_names}")
        if mesh.size(2) != 1:
            raise ValueError(f"SequenceParallelMPU needs a mesh with tp = 1, got tp = {mesh.size(2)}")
        self.mesh = mesh  # the one source of every group below
        self._sp_group = mesh.get_group("sp")
        self._dp_group = mesh.get_group("dp")
        self._tp_group = mesh.get_group("tp")
        # The mesh spans the whole default group (init_parallel_mesh), so sp x dp is the world.
        self._sdp_group = dist.group.WORLD

    @classmethod
    def build(cls, sequence_parallel_size: int, device_type: str | None = None) -> SequenceParallelMPU:
        """``SequenceParallelMPU(init_parallel_mesh(sequence_parallel_size, device_type))``; same errors."""
        return cls(init_parallel_mesh(sequence_parallel_size, device_type))

    def get_sequence_parallel_group(self):
        """The sequence-parallel group of this rank."""
        return self._sp_group

    def get_sequence_parallel_world_size(self) -> int:
        """Ranks sharing one sequence (``sequence_parallel_size``)."""
        return self.mesh.size(1)

    def get_sequence_parallel_rank(self) -> int:
        """This rank's index in its sequence-parallel group: which sequence shard it holds."""
        return self.mesh.get_local_rank("sp")

    def get_data_parallel_group(self):
        """The data-parallel group of this rank (same sequence-parallel rank, different samples)."""
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        """world size // ``sequence_parallel_size``."""
        return self.mesh.size(0)

    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self.mesh.get_local_rank("dp")

    def get_sequence_data_parallel_group(self):
        """sp x dp: every rank of the mesh (the group ZeRO shards over under sequence parallelism)."""
        return self._sdp_group

    def get_sequence_data_parallel_world_size(self) -> int:
        """sp x dp: the world size."""
        return self.mesh.size(0) * self.mesh.size(1)

    def get_sequence_data_parallel_rank(self) -> int:
        """This rank's index in sp x dp: ``dp_rank * sp + sp_rank`` (its global rank)."""
        return self.get_data_parallel_rank() * self.mesh.size(1) + self.get_sequence_parallel_rank()

    def get_model_parallel_group(self):
        """The tensor-parallel group: this rank alone (tensor parallelism has size 1)."""
        return self._tp_group

    def get_model_parallel_world_size(self) -> int:
        """1: parameters are not split across ranks."""
        return self.mesh.size(2)

    def get_model_parallel_rank(self) -> int:
        """0."""
        return self.mesh.get_local_rank("tp")
