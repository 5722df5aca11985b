"""Flat, range-sharded layout: flat groups made of buckets, each bucket padded so its shards are equal.

A *flat group* holds the parameters of one optimizer param group and one dtype (or the frozen parameters of one
dtype, ``group_index=None``), concatenated in model order. It is cut into *buckets* (contiguous runs of whole
parameters; at stage 3 a bucket is the unit gathered together, FSDP1-style). Each bucket is padded to a multiple of
the partition count ``P`` and split into ``P`` equal *chunks*; chunk ``r`` belongs to rank ``r``. Chunk boundaries
ignore parameter boundaries (as in Megatron's distributed optimizer). A rank's *shard* of the flat group is the
concatenation of its chunks of every bucket, in bucket order; its fp32 master weights and optimizer state have
exactly that shape. ``full_from_shards`` / ``shard_from_full`` convert between shards and the unpadded flat vector
for any partition count, which is what resharding checkpoints need.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from zero_core.zero_init import logical_shape


class ShardState(enum.Enum):
    """Whether a bucket's full parameters are materialised (stage 3; stages 0-2 are always GATHERED)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass
class ParamSlot:
    """One parameter's place. ``offset``: start in the flat group's unpadded vector; ``bucket_offset``: start in its
    bucket (elements). ``name`` is the ``module.named_parameters()`` name."""

    name: str
    param: torch.nn.Parameter
    shape: torch.Size
    numel: int
    offset: int = 0
    bucket_offset: int = 0
    param_index: int = 0

    @property
    def trainable(self) -> bool:
        """The parameter gets gradients (and a master copy)."""
        return self.param.requires_grad


@dataclass(eq=False)
class Bucket:
    """A contiguous run of whole parameters of one flat group; one collective each for reduce and gather.

    Layout: ``start``/``numel`` in the flat group's unpadded vector, ``padded_numel`` (a multiple of the partition
    count), ``chunk`` = padded_numel / P elements per rank, ``shard_offset`` = where this bucket's chunk sits in
    a rank's shard. Runtime state (explicit, not on the parameters): ``full`` (the compute-dtype buffer the
    parameters view), ``state``, gradient readiness and the pending collective.
    """

    index: int
    group: FlatGroup
    slots: list[ParamSlot]
    start: int
    numel: int
    padded_numel: int
    chunk: int
    shard_offset: int
    persistent: bool = True
    full: torch.Tensor | None = None
    state: ShardState = ShardState.GATHERED
    grad: torch.Tensor | None = None
    expected_grads: int = 0
    ready_grads: int = 0
    launched: bool = False
    pending: object = None
    gather_handle: object = None

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Bucket-local [start, end) of rank's chunk (may cover padding past ``numel``)."""
        return rank * self.chunk, (rank + 1) * self.chunk


@dataclass(eq=False)
class FlatGroup:
    """One (optimizer param group, dtype) flat buffer; what checkpoints save and reshard.

    Attributes:
        index: position in ``runtime.flat_groups``.
        group_index: the optimizer param-group index, or None for frozen parameters.
        dtype: parameter storage/communication dtype.
        slots: the parameters in flat order (names, shapes, offsets, numels).
        buckets: the buckets in flat order.
        partitions: partition count P (world size; 1 at stage 0, and for frozen parameters below stage 3).
        rank: this rank's partition index.
        numel / padded_numel / shard_numel: elements unpadded, padded (sum of buckets), and per rank.
        master: this rank's fp32 master shard (the optimizer's parameter; ``shard_numel`` elements), or None.
        grad: this rank's accumulated gradient shard (``grad_accum_dtype``), or None before any backward.
        param_shard: stage 3: this rank's shard in ``dtype`` (aliases ``master`` when the dtypes match).
        device: where the buffers live (the parameters' device).
    """

    index: int
    group_index: int | None
    dtype: torch.dtype
    partitions: int
    rank: int
    slots: list[ParamSlot] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    master: torch.nn.Parameter | None = None
    grad: torch.Tensor | None = None
    param_shard: torch.Tensor | None = None
    device: torch.device = torch.device("cpu")

    @property
    def numel(self) -> int:
        """Unpadded elements."""
        return sum(b.numel for b in self.buckets)

    @property
    def padded_numel(self) -> int:
        """Padded elements over all ranks."""
        return sum(b.padded_numel for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's shard."""
        return sum(b.chunk for b in self.buckets)

    @property
    def names(self) -> list[str]:
        """Parameter names in flat order."""
        return [s.name for s in self.slots]

    def shard_ranges(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """(flat_start, flat_end, shard_start) for each piece of real (unpadded) data ``rank`` owns."""
        rank = self.rank if rank is None else rank
        out = []
        for b in self.buckets:
            lo, hi = b.chunk_range(rank)
            hi = min(hi, b.numel)
            if hi > lo:
                out.append((b.start + lo, b.start + hi, b.shard_offset))
        return out

    def full_from_shards(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Unpadded flat vector (``numel``) from every rank's shard (list of ``partitions`` tensors of
        ``shard_numel`` elements each, rank order). Raises ValueError on a wrong count or size."""
        if len(shards) != self.partitions or any(s.numel() != self.shard_numel for s in shards):
            raise ValueError(
                f"flat group {self.index}: expected {self.partitions} shards of {self.shard_numel} elements, got "
                f"{[s.numel() for s in shards]}"
            )
        pieces = []
        for b in self.buckets:
            whole = torch.cat([s.reshape(-1)[b.shard_offset : b.shard_offset + b.chunk] for s in shards])
            pieces.append(whole[: b.numel])
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=shards[0].dtype if shards else self.dtype)

    def shard_from_full(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """Rank's shard (``shard_numel``, zero padding) of an unpadded flat vector of ``numel`` elements."""
        rank = self.rank if rank is None else rank
        if full.numel() != self.numel:
            raise ValueError(f"flat group {self.index}: expected a flat vector of {self.numel} elements, got "
                             f"{full.numel()}")  # fmt: skip
        out = torch.zeros(self.shard_numel, dtype=full.dtype, device=full.device)
        flat = full.reshape(-1)
        for b in self.buckets:
            lo, hi = b.chunk_range(rank)
            hi_real = min(hi, b.numel)
            if hi_real > lo:
                out[b.shard_offset : b.shard_offset + hi_real - lo] = flat[b.start + lo : b.start + hi_real]
        return out

    def describe(self) -> dict:
        """Plain-data layout (for checkpoint metadata): names, shapes, offsets, numels, buckets, partitions."""
        return {
            "group_index": self.group_index,
            "dtype": str(self.dtype),
            "partitions": self.partitions,
            "names": self.names,
            "shapes": [list(s.shape) for s in self.slots],
            "offsets": [s.offset for s in self.slots],
            "numels": [s.numel for s in self.slots],
            "buckets": [(b.start, b.numel, b.padded_numel) for b in self.buckets],
            "numel": self.numel,
            "padded_numel": self.padded_numel,
            "shard_numel": self.shard_numel,
        }


def build_flat_group(
    index: int,
    group_index: int | None,
    dtype: torch.dtype,
    partitions: int,
    rank: int,
    bucket_params: list[list[tuple[str, torch.nn.Parameter]]],
    persistent: list[bool],
    first_bucket_index: int,
    model_order: dict[int, int],
) -> FlatGroup:
    """Lay out ``bucket_params`` (buckets in flat order, each a list of (name, param)) as one flat group.
    ``model_order`` maps ``id(param)`` to its position in ``module.named_parameters()``."""
    fg = FlatGroup(index, group_index, dtype, partitions, rank)
    first = next((p for params in bucket_params for _, p in params), None)
    fg.device = first.device if first is not None else torch.device("cpu")
    offset = shard_offset = 0
    for i, (params, keep) in enumerate(zip(bucket_params, persistent)):
        slots, local = [], 0
        for name, p in params:
            shape = logical_shape(p)
            slot = ParamSlot(name, p, shape, shape.numel(), offset + local, local, model_order[id(p)])
            slots.append(slot)
            local += slot.numel
        padded = max(1, math.ceil(local / partitions)) * partitions
        bucket = Bucket(first_bucket_index + i, fg, slots, offset, local, padded, padded // partitions, shard_offset)
        bucket.persistent = keep
        bucket.expected_grads = sum(1 for s in slots if s.trainable and s.numel > 0)
        fg.buckets.append(bucket)
        fg.slots += slots
        offset += local
        shard_offset += bucket.chunk
    return fg


def split_by_size(params: list[tuple[str, torch.nn.Parameter]], bucket_numel: int) -> list[list]:
    """Cut ``params`` (flat order) into buckets of at most ``bucket_numel`` elements, filling from the end (the
    order backward produces gradients); a parameter larger than a bucket gets a bucket of its own."""
    buckets: list[list] = []
    current: list = []
    size = 0
    for item in reversed(params):
        n = logical_shape(item[1]).numel()
        if current and size + n > bucket_numel:
            buckets.append(current[::-1])
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        buckets.append(current[::-1])
    return buckets[::-1]
