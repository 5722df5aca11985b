"""How :mod:`zero.activation_checkpointing.api` keeps a checkpointed segment's inputs between forward and recompute.

DeepSpeed's options (``deepspeed/runtime/activation_checkpointing``), each a copy that gives back the same bits:

* ``partition_activations``: each rank of the model-parallel group (where the activation is replicated) keeps only
  its ``1/w`` slice of every floating-point input; backward all-gathers the slices (zero_comm) to rebuild it.
* ``cpu_checkpointing``: the kept piece lives in host memory and returns to its device for the recompute.
* ``contiguous_memory_optimization``: pieces are copied into one preallocated buffer per argument position with
  ``number_checkpoints`` slots (no allocation per layer); a slot is reused once every stored checkpoint was used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zero_comm import all_gather_into_tensor


@dataclass
class Settings:
    """What ``configure`` set. ``group``: the model-parallel group inputs are partitioned over (None: no
    partitioning possible, inputs kept whole as DeepSpeed does with one model-parallel rank)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    group: object = None
    configured: bool = False
    buffers: dict = field(default_factory=dict)  # (arg position, numel, dtype, device) -> (num_checkpoints, numel)
    live: int = 0  # checkpoints stored and not yet recomputed
    kept_bytes: int = 0  # bytes of stored inputs held now on this rank (the benchmark reads it)
    next_slot: int = 0
    timings: list = field(default_factory=list)  # (phase, seconds) per call when profile is on

    @property
    def custom_storage(self) -> bool:
        """Whether inputs are stored other than by reference (then the segment runs through CheckpointFunction)."""
        return self.partition_activations or self.cpu_checkpointing or self.contiguous_memory_optimization


@dataclass
class Stored:
    """One input as kept: the piece, the full shape, and how to rebuild it."""

    piece: torch.Tensor
    shape: torch.Size
    numel: int
    device: torch.device
    requires_grad: bool
    partitioned: bool


def _world(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_initialized():
        return 1, 0
    return group.size(), torch.distributed.get_rank(group)


def store(s: Settings, position: int, t: torch.Tensor, slot: int) -> Stored:
    """Keep floating-point tensor ``t`` (argument ``position``) as ``s`` says; ``slot`` is this checkpoint's
    index in the contiguous buffers."""
    world, rank = _world(s.group) if s.partition_activations else (1, 0)
    flat = t.detach().reshape(-1)
    numel = flat.numel()
    chunk = -(-numel // world)
    piece = flat[rank * chunk : min((rank + 1) * chunk, numel)]
    if piece.numel() < chunk:  # the last rank's slice is padded so every slice has one size
        piece = torch.cat([piece, piece.new_zeros(chunk - piece.numel())])
    target = torch.device("cpu") if s.cpu_checkpointing else t.device
    if s.contiguous_memory_optimization:
        key = (position, chunk, t.dtype, target)
        if key not in s.buffers:
            s.buffers[key] = torch.empty(s.number_checkpoints, chunk, dtype=t.dtype, device=target)
        kept = s.buffers[key][slot].copy_(piece)
    else:
        kept = piece.to(target, copy=True)
    s.kept_bytes += kept.numel() * kept.element_size()
    return Stored(kept, t.shape, numel, t.device, t.requires_grad, world > 1)


def restore(s: Settings, st: Stored) -> torch.Tensor:
    """The full tensor back on its device (collective over the group when it was partitioned)."""
    s.kept_bytes -= st.piece.numel() * st.piece.element_size()
    piece = st.piece.to(st.device)
    if st.partitioned:
        world = s.group.size()
        full = torch.empty(world * piece.numel(), dtype=piece.dtype, device=piece.device)
        all_gather_into_tensor(full, piece.contiguous(), s.group)
        piece = full
    return piece[: st.numel].view(st.shape).clone()
