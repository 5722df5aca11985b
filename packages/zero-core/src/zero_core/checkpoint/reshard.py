"""Pure functions that rebuild flat buffers saved as N shards and re-slice them for M shards.

Everything goes through per-parameter element ranges by name, so a stage-2 layout (one buffer per param group)
maps onto a stage-3 layout (one buffer per unit of modules) as easily as N ranks map onto M. Only the element
ranges a destination shard needs are read (safetensors reads slices lazily), so memory stays at one shard.

Tensor keys inside a rank's shard file (and in :class:`DictShardSource`):
``master/<group key>`` for the fp32 master weights and ``optim/<state name>/<group key>`` for optimizer state
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``step``, ...). A state tensor of shape ``(shard_numel,)`` is
per element and gets resharded; any other shape (a 0-dim ``step``) is per buffer and must agree between the
buffers a destination buffer draws from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from zero_core.checkpoint.layout import CheckpointLayout, LayoutMismatchError, check_compatible
from zero_core.layout import FlatGroup


def master_key(group_key: str) -> str:
    """File key of a buffer's fp32 master shard."""
    return f"master/{group_key}"


def optim_key(state_name: str, group_key: str) -> str:
    """File key of one optimizer state tensor of a buffer's shard."""
    return f"optim/{state_name}/{group_key}"


class ShardSource(Protocol):
    """Read access to the tensors of the N shard files of one checkpoint (rank = shard index)."""

    def keys(self, rank: int) -> list[str]: ...

    def shape(self, rank: int, key: str) -> tuple[int, ...]: ...

    def get(self, rank: int, key: str) -> torch.Tensor: ...

    def read(self, rank: int, key: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the 1-D tensor ``key`` of shard ``rank``."""
        ...


class DictShardSource:
    """A :class:`ShardSource` over in-memory dicts, one per rank (tests, and the in-process N -> M path)."""

    def __init__(self, shards: Sequence[dict[str, torch.Tensor]]):
        self.shards = list(shards)

    def keys(self, rank: int) -> list[str]:
        return list(self.shards[rank])

    def shape(self, rank: int, key: str) -> tuple[int, ...]:
        return tuple(self.shards[rank][key].shape)

    def get(self, rank: int, key: str) -> torch.Tensor:
        return self.shards[rank][key]

    def read(self, rank: int, key: str, start: int, end: int) -> torch.Tensor:
        return self.shards[rank][key][start:end]


def shard_index(group: FlatGroup, rank: int) -> int:
    """Which shard of ``group`` rank ``rank`` holds (0 for a group every rank holds whole)."""
    return rank if group.partitions > 1 else 0


def read_param(
    layout: CheckpointLayout, source: ShardSource, kind: str, name: str, start: int = 0, end: int | None = None
) -> torch.Tensor:
    """Elements ``[start, end)`` (default: all) of parameter ``name``, flattened, from its saved shards.

    Args:
        kind: ``"master"`` or ``"optim/<state name>"``.

    Returns:
        a 1-D tensor in the saved dtype (fp32 for master weights).
    """
    group, slot, chunk, shard_offset = layout.locate()[name]
    end = slot.numel if end is None else end
    key = f"{kind}/{group.key}"
    a, b = slot.bucket_offset + start, slot.bucket_offset + end  # positions in the bucket
    pieces = []
    while a < b:
        rank = a // chunk
        stop = min(b, (rank + 1) * chunk)
        lo = shard_offset + a - rank * chunk
        pieces.append(source.read(rank, key, lo, lo + stop - a))
        a = stop
    if not pieces:
        return torch.empty(0, dtype=source.get(0, key).dtype)
    return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)


def build_shard(saved: CheckpointLayout, source: ShardSource, kind: str, dst: FlatGroup, rank: int) -> torch.Tensor:
    """Shard ``rank`` of buffer ``dst`` (shape ``(dst.shard_numel,)``) filled from the saved shards; padding is 0.

    When ``dst`` is laid out exactly as a saved buffer of the same key, the saved shard is read whole.
    """
    by_key = {g.key: g for g in saved.groups}
    if dst.key in by_key and by_key[dst.key].same_layout(dst):
        return source.read(rank, f"{kind}/{dst.key}", 0, dst.shard_numel).clone()
    index = saved.param_index()
    # a parameter saved frozen (no optimizer state) in a trainable buffer now: its state stays 0, and the
    # buffer's dtype comes from a parameter saved trainable (frozen buffers keep the model dtype)
    stateless = kind.startswith("optim/") or dst.group_index is not None
    params = [p for p in dst.slots if not (stateless and index[p.name][0].group_index is None)] or dst.slots
    dtype = source.get(0, f"{kind}/{index[params[0].name][0].key}").dtype if params else torch.float32
    out = torch.zeros(dst.shard_numel, dtype=dtype)
    for bucket in dst.buckets:
        lo, hi = bucket.chunk_range(rank)
        shard_offset = bucket.shard_offset
        for p in bucket.slots:
            if kind.startswith("optim/") and index[p.name][0].group_index is None:
                continue
            a, b = max(lo, p.bucket_offset), min(hi, p.bucket_offset + p.numel)
            if a < b:
                at = shard_offset + a - lo
                out[at : at + b - a] = read_param(saved, source, kind, p.name, a - p.bucket_offset, b - p.bucket_offset)
    return out


def saved_state_names(saved: CheckpointLayout, source: ShardSource, group_key: str) -> list[str]:
    """Names of the optimizer state tensors saved for buffer ``group_key`` (sorted)."""
    suffix = "/" + group_key
    return sorted(
        k[len("optim/") : -len(suffix)] for k in source.keys(0) if k.startswith("optim/") and k.endswith(suffix)
    )


def build_optimizer_state(
    saved: CheckpointLayout, source: ShardSource, dst: FlatGroup, rank: int
) -> dict[str, torch.Tensor]:
    """The optimizer state of shard ``rank`` of buffer ``dst``: per-element tensors resharded, others copied.

    Raises:
        LayoutMismatchError: the saved buffers that ``dst`` draws from hold different state names, or different
            values of a per-buffer state (e.g. ``step``), so no single value is right.
    """
    index = saved.param_index()
    by_key = {g.key: g for g in saved.groups}
    # saved frozen buffers hold no optimizer state: a parameter from one starts without (per-element step 0)
    sources = list(dict.fromkeys(index[p.name][0].key for p in dst.slots if index[p.name][0].group_index is not None))
    fresh = [p for p in dst.slots if index[p.name][0].group_index is None]
    names = {k: saved_state_names(saved, source, k) for k in sources}
    if len({tuple(v) for v in names.values()}) > 1:
        raise LayoutMismatchError(
            f"buffer {dst.key!r} draws from saved buffers with different optimizer state: {names}"
        )
    out: dict[str, torch.Tensor] = {}
    for name in names[sources[0]] if sources else []:
        first = by_key[sources[0]]
        if source.shape(0, optim_key(name, first.key)) == (first.shard_numel,):
            out[name] = build_shard(saved, source, f"optim/{name}", dst, rank)
            continue
        values = [source.get(0, optim_key(name, k)) for k in sources]
        for k, v in zip(sources[1:], values[1:]):
            if v.shape != values[0].shape or not torch.equal(v, values[0]):
                raise LayoutMismatchError(
                    f"optimizer state {name!r} differs between saved buffers {sources[0]!r} ({values[0].tolist()}) "
                    f"and {k!r} ({v.tolist()}); cannot merge them into buffer {dst.key!r}"
                )
        out[name] = values[0].clone()
        if fresh and values[0].dim() == 0:  # per element: the value for saved-trainable parameters, 0 elsewhere
            out[name] = _per_element(dst, rank, values[0], {p.name for p in fresh})
    return out


def _per_element(dst: FlatGroup, rank: int, value: torch.Tensor, zero: set[str]) -> torch.Tensor:
    out = torch.zeros(dst.shard_numel, dtype=torch.float32)
    for bucket in dst.buckets:
        lo, hi = bucket.chunk_range(rank)
        shard_offset = bucket.shard_offset
        for p in bucket.slots:
            a, b = max(lo, p.bucket_offset), min(hi, p.bucket_offset + p.numel)
            if a < b and p.name not in zero:
                out[shard_offset + a - lo : shard_offset + b - lo] = float(value)
    return out


def reshard(
    saved: CheckpointLayout, source: ShardSource, current: CheckpointLayout, rank: int, optimizer_state: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Master shards and optimizer state of ``rank`` under ``current``, from a checkpoint saved under ``saved``.

    Returns:
        ``(masters, states)``: group key -> fp32 master shard ``(shard_numel,)``; group key -> state name -> tensor
        (empty dicts when ``optimizer_state`` is False).

    Raises:
        LayoutMismatchError: the layouts hold different parameters, shapes or optimizer group indices.
    """
    check_compatible(saved, current)
    masters = {g.key: build_shard(saved, source, "master", g, shard_index(g, rank)) for g in current.groups}
    states = {}
    if optimizer_state:
        states = {g.key: build_optimizer_state(saved, source, g, shard_index(g, rank)) for g in current.groups}
    return masters, states
