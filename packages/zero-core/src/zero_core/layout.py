"""The one layout: flat groups made of buckets, each bucket padded so its shards are equal (frozen, in elements).

A *flat group* holds the parameters of one optimizer param group and one dtype (or the frozen parameters of one
dtype, ``group_index=None``), concatenated in model order. It is cut into *buckets* (contiguous runs of whole
parameters; at stage 3 a bucket is the unit gathered together, FSDP1-style). Each bucket is padded to a multiple of
the partition count ``P`` and split into ``P`` equal *chunks*; chunk ``r`` belongs to rank ``r``. Chunk boundaries
ignore parameter boundaries (as in Megatron's distributed optimizer). A rank's *shard* of the flat group is the
concatenation of its chunks of every bucket, in bucket order; its fp32 master weights and optimizer state have
exactly that shape. ``full_from_shards`` / ``shard_from_full`` convert between shards and the unpadded flat vector
for any partition count, which is what resharding checkpoints need.

These objects are frozen: they say what lives where and never change while a runtime lives. The runtime, the
checkpoints (save, load, reshard, consolidate; ``to_dict`` / ``from_dict`` is the JSON form they store), zero-offload
and zero-compile all read them. Runtime state lives with its owner: gathered buffers, shard states and gather
handles in the parameter store (``DenseParamStore`` / ``stage3.Stage3``), bucket gradients, readiness and the
gradient shard in the gradient reduction (``reducer.GradReducer``), the master shard in the master store.
Megatron separates its bucket (views, offsets) from its bucket group (handles) the same way; FSDP2 its
``FSDPParam`` from ``FSDPParamGroup``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from zero_comm import plan_buckets
from zero_core.partition_records import logical_shape


class LayoutError(ValueError):
    """A layout (built here or read from a checkpoint) is inconsistent; the message names the group and bucket."""


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place.

    Attributes:
        name: the ``module.named_parameters()`` name.
        shape: its logical (unsharded) shape.
        numel: elements.
        offset: first element in the flat group's unpadded vector.
        bucket_offset: first element in its bucket.
        param_index: position in ``module.named_parameters()`` (0 for a layout read from a checkpoint).
        dtype: the model-side dtype name (e.g. ``"bfloat16"``), recorded in checkpoints.
        param: the ``Parameter`` itself (None for a layout read from a checkpoint); not part of equality.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int
    bucket_offset: int
    param_index: int = 0
    dtype: str = "float32"
    param: torch.nn.Parameter | None = field(default=None, compare=False, repr=False)

    @property
    def trainable(self) -> bool:
        """The parameter gets gradients now (``requires_grad`` may change during training)."""
        return self.param is not None and self.param.requires_grad


@dataclass(frozen=True, eq=False)
class Bucket:
    """A contiguous run of whole parameters of one flat group; one collective each for reduce and gather.

    Attributes:
        index: position among every bucket of the runtime (flat groups in order), so runtime owners keep
            per-bucket state in lists; a bucket is hashed by identity.
        slots: its parameters, flat order.
        start / numel: first element and element count in the flat group's unpadded vector.
        padded_numel: ``numel`` rounded up to a multiple of the partition count.
        chunk: ``padded_numel / P`` elements per rank.
        shard_offset: where this bucket's chunk sits in a rank's shard.
        persistent: stage 3: stays gathered between uses (small parameters).
        group: the flat group it belongs to (set once when the group is built).
    """

    index: int
    slots: tuple[ParamSlot, ...]
    start: int
    numel: int
    padded_numel: int
    chunk: int
    shard_offset: int
    persistent: bool = True
    group: FlatGroup | None = field(default=None, repr=False)

    def chunk_range(self, rank: int) -> tuple[int, int]:
        """Bucket-local [start, end) of rank's chunk (may cover padding past ``numel``)."""
        return rank * self.chunk, (rank + 1) * self.chunk

    def shard_slice(self) -> slice:
        """This bucket's chunk inside a rank's shard: ``shard[bucket.shard_slice()]`` (``chunk`` elements)."""
        return slice(self.shard_offset, self.shard_offset + self.chunk)

    def same_layout(self, other: Bucket) -> bool:
        """Same parameters at the same places and the same padding (what resharding compares)."""

        def places(b: Bucket) -> list:
            return [(s.name, tuple(s.shape), s.bucket_offset) for s in b.slots]

        return (self.numel, self.padded_numel) == (other.numel, other.padded_numel) and places(self) == places(other)


@dataclass(frozen=True, eq=False)
class FlatGroup:
    """One (optimizer param group, dtype) flat buffer; what checkpoints save and reshard.

    Attributes:
        index: position in ``runtime.flat_groups``.
        group_index: the optimizer param-group index, or None for frozen parameters.
        dtype: parameter storage/communication dtype.
        partitions: partition count P (world size; 1 at stage 0, and for frozen parameters below stage 3).
        rank: this rank's partition index (0 for a layout read from a checkpoint).
        buckets: the buckets in flat order.
        device: where the buffers live (the parameters' device).
        key: the name checkpoints file it under (default ``group<index>``).
        numel / padded_numel / shard_numel: elements unpadded, padded (sum of buckets), and per rank.
    """

    index: int
    group_index: int | None
    dtype: torch.dtype
    partitions: int
    rank: int
    buckets: tuple[Bucket, ...]
    device: torch.device = torch.device("cpu")
    key: str = ""

    def __post_init__(self) -> None:
        # frozen: derived sizes and the buckets' back-references are set once here
        if not self.key:
            object.__setattr__(self, "key", f"group{self.index}")
        for b in self.buckets:
            object.__setattr__(b, "group", self)
        object.__setattr__(self, "slots", tuple(s for b in self.buckets for s in b.slots))
        object.__setattr__(self, "numel", sum(b.numel for b in self.buckets))
        object.__setattr__(self, "padded_numel", sum(b.padded_numel for b in self.buckets))
        object.__setattr__(self, "shard_numel", sum(b.chunk for b in self.buckets))
        self.check()

    slots: tuple[ParamSlot, ...] = field(init=False, repr=False)
    numel: int = field(init=False)
    padded_numel: int = field(init=False)
    shard_numel: int = field(init=False)

    @property
    def names(self) -> list[str]:
        """Parameter names in flat order."""
        return [s.name for s in self.slots]

    def check(self) -> None:
        """Raise :class:`LayoutError` naming the group and bucket when sizes, offsets or padding disagree."""
        start = shard = 0
        for i, b in enumerate(self.buckets):
            where = f"flat group {self.key!r} bucket {i}"
            if b.padded_numel % self.partitions or b.chunk * self.partitions != b.padded_numel:
                raise LayoutError(f"{where}: padded_numel {b.padded_numel} is not a multiple of world_size "
                                  f"{self.partitions} (chunk {b.chunk})")  # fmt: skip
            if b.padded_numel < b.numel:
                raise LayoutError(f"{where}: padded_numel {b.padded_numel} < numel {b.numel}")
            if (b.start, b.shard_offset) != (start, shard):
                raise LayoutError(f"{where}: starts at {b.start} / shard offset {b.shard_offset}, expected {start} / "
                                  f"{shard}")  # fmt: skip
            end = 0
            for s in b.slots:
                if s.bucket_offset < end:
                    raise LayoutError(f"{where}: parameter {s.name!r} at offset {s.bucket_offset} overlaps")
                end = s.bucket_offset + s.numel
            if end > b.numel:
                raise LayoutError(f"{where}: parameters end at {end} > numel {b.numel}")
            start += b.numel
            shard += b.chunk

    def same_layout(self, other: FlatGroup) -> bool:
        """Same key, optimizer group, partition count and buckets (a saved shard can be read whole)."""
        return (
            (self.key, self.group_index, self.partitions, len(self.buckets))
            == (other.key, other.group_index, other.partitions, len(other.buckets))
            and all(a.same_layout(b) for a, b in zip(self.buckets, other.buckets))
        )  # fmt: skip

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

    def slot_pieces(self, rank: int | None = None) -> list[tuple[int, int, int]]:
        """(slot index, shard start, shard end) for each parameter with elements in ``rank``'s shard, in shard
        order: how a per-parameter optimizer or state lookup cuts the shard."""
        rank = self.rank if rank is None else rank
        out, i = [], 0
        for b in self.buckets:
            lo, hi = b.chunk_range(rank)
            for s in b.slots:
                start, end = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.numel)
                if end > start:
                    a = b.shard_offset + start - lo
                    out.append((i, a, a + end - start))
                i += 1
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
            whole = torch.cat([s.reshape(-1)[b.shard_slice()] for s in shards])
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

    # ------------------------------------------------------------ the JSON form checkpoints store
    def to_dict(self) -> dict:
        """JSON-able form (checkpoint format version 1): key, optimizer group, buckets of (name, shape, dtype,
        bucket offset) slots with their numel/padded_numel, and the partition count as ``world_size``."""
        return {
            "key": self.key,
            "optim_group": self.group_index,
            "buckets": [
                {
                    "params": [
                        {"name": s.name, "shape": list(s.shape), "dtype": s.dtype, "offset": s.bucket_offset}
                        for s in b.slots
                    ],  # fmt: skip
                    "numel": b.numel,
                    "padded_numel": b.padded_numel,
                }
                for b in self.buckets
            ],
            "world_size": self.partitions,
        }

    @classmethod
    def from_dict(cls, d: dict, index: int = 0) -> FlatGroup:
        """The layout ``to_dict`` wrote (no parameters attached, rank 0, CPU).

        Raises:
            LayoutError: a missing or malformed field, or sizes that do not fit (naming the group and bucket).
        """
        try:
            key, world, optim_group = d["key"], int(d["world_size"]), d.get("optim_group")
            if not isinstance(key, str) or not key or "/" in key:
                raise LayoutError(f"flat group key {key!r} must be a non-empty string without '/'")
            if world < 1 or (optim_group is not None and int(optim_group) < 0):
                raise LayoutError(f"flat group {key!r}: world_size {world} / optim_group {optim_group} out of range")
            buckets, start, shard, flat_index = [], 0, 0, 0
            for b in d["buckets"]:
                numel, padded = int(b["numel"]), int(b["padded_numel"])
                slots = []
                for p in b["params"]:
                    shape = tuple(int(x) for x in p["shape"])
                    n = math.prod(shape)
                    off = int(p["offset"])
                    if off < 0:
                        raise LayoutError(f"flat group {key!r}: parameter {p['name']!r} at negative offset {off}")
                    slots.append(ParamSlot(str(p["name"]), shape, n, start + off, off, flat_index,
                                           str(p.get("dtype", "float32"))))  # fmt: skip
                    flat_index += 1
                buckets.append(Bucket(len(buckets), tuple(slots), start, numel, padded, padded // world, shard))
                start += numel
                shard += padded // world
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"flat group {d.get('key') if isinstance(d, dict) else d!r}: malformed layout: "
                              f"{type(e).__name__}: {e}") from e  # fmt: skip
        dtype = getattr(torch, buckets[0].slots[0].dtype) if buckets and buckets[0].slots else torch.float32
        return cls(index, None if optim_group is None else int(optim_group), dtype, world, 0, tuple(buckets), key=key)

    @classmethod
    def of(cls, key: str, optim_group: int | None, world: int, buckets: list[list[tuple[str, tuple]]],
           padded: list[int] | None = None) -> FlatGroup:  # fmt: skip
        """A layout from names and shapes (tests, tools): ``buckets`` holds (name, shape) lists in flat order;
        each bucket padded to ``padded[i]`` elements (default: the next multiple of ``world``)."""
        out = []
        for i, params in enumerate(buckets):
            pos, ps = 0, []
            for name, shape in params:
                ps.append({"name": name, "shape": list(shape), "offset": pos})
                pos += math.prod(shape)
            pad = padded[i] if padded is not None else max(1, math.ceil(pos / world)) * world
            out.append({"params": ps, "numel": pos, "padded_numel": pad})
        return cls.from_dict({"key": key, "optim_group": optim_group, "buckets": out, "world_size": world})


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
    first = next((p for params in bucket_params for _, p in params), None)
    device = first.device if first is not None else torch.device("cpu")
    buckets = []
    offset = shard_offset = 0
    for i, (params, keep) in enumerate(zip(bucket_params, persistent)):
        slots, local = [], 0
        for name, p in params:
            shape = logical_shape(p)
            rec_dtype = str(dtype).removeprefix("torch.")
            slots.append(ParamSlot(name, shape, shape.numel(), offset + local, local, model_order[id(p)], rec_dtype, p))
            local += shape.numel()
        padded = max(1, math.ceil(local / partitions)) * partitions
        chunk = padded // partitions
        buckets.append(Bucket(first_bucket_index + i, tuple(slots), offset, local, padded, chunk, shard_offset, keep))
        offset += local
        shard_offset += chunk
    return FlatGroup(index, group_index, dtype, partitions, rank, tuple(buckets), device)


def split_by_size(params: list[tuple], bucket_numel: int, numel_of=None) -> list[list]:
    """Cut ``params`` (flat order; ``(name, parameter)`` pairs) into buckets of at most ``bucket_numel`` elements,
    filling from the end (the order backward produces gradients); a parameter larger than a bucket gets a bucket of
    its own. ``numel_of(item)``: an item's elements (default: its parameter's logical shape). The cut is
    ``zero_comm.plan_buckets``'s, the planner of zero-comm's bucketed collectives."""
    sizes = [numel_of(item) if numel_of is not None else logical_shape(item[1]).numel() for item in params]
    return [params[run.start : run.stop] for run in plan_buckets(sizes, bucket_numel, from_end=True)]
