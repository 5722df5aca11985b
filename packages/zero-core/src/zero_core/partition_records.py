"""The records of parameters partitioned at construction (``zero_core.zero_init``): what each one really is
(shape, dtype, this rank's shard, its group), read by the layout, the ``ds_*`` properties and
``GatheredParameters``. A leaf module (zero_comm only), so every reader can import it without importing
``zero_init`` or the stage-3 store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zero_comm import all_gather_into_tensor


@dataclass
class PartitionedParam:
    """What a partitioned parameter really is: ``shape``, ``numel``, ``dtype``, this rank's ``shard`` (``chunk``
    elements of the zero-padded flat value), the process ``group`` and how many times it was partitioned."""

    shape: torch.Size
    numel: int
    dtype: torch.dtype
    shard: torch.Tensor | None
    group: object
    partitions: int = 1
    init: object = None  # deferred (``zero_core.deferred_init``): ``init()`` gives the full value, no shard yet


_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> its PartitionedParam; an entry dies with its parameter (no id() reuse, nothing left behind)."""


def partitioned_record(p: torch.Tensor) -> PartitionedParam | None:
    """The record of a parameter partitioned by ``zero_init`` (None if it is not partitioned)."""
    return _RECORDS.get(p)


def logical_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's real shape (its record's for a partitioned parameter)."""
    rec = partitioned_record(p)
    return rec.shape if rec is not None else p.shape


def record(p: torch.Tensor, rec: PartitionedParam) -> None:
    """Make ``rec`` the record of ``p`` (``zero_init`` partitioning it, ``zero_core.deferred_init`` deferring it)."""
    _RECORDS[p] = rec


def register_copy(p: torch.nn.Parameter, rec: PartitionedParam) -> None:
    """Make ``p`` (an empty parameter) partitioned like ``rec``: this rank's partition cloned, no communication
    (``copy.deepcopy`` of a partitioned parameter)."""
    shard = rec.shard.clone() if rec.shard is not None else None
    _RECORDS[p] = PartitionedParam(rec.shape, rec.numel, rec.dtype, shard, rec.group, rec.partitions, rec.init)


@torch.no_grad()
def gather_partitioned(p: torch.Tensor, group=None) -> torch.Tensor:
    """The full value of ``p`` (collective when ``p`` is partitioned; else ``p`` itself, detached)."""
    rec = partitioned_record(p)
    if rec is None:
        return p.detach()
    if rec.init is not None:  # deferred: the same value on every rank by construction (no collective)
        return rec.init().reshape(rec.shape)
    world = rec.group.size()
    out = torch.empty(rec.shard.numel() * world, dtype=rec.dtype, device=rec.shard.device)
    all_gather_into_tensor(out, rec.shard, rec.group)
    return out[: rec.numel].view(rec.shape)


def forget(p: torch.Tensor) -> None:
    """Drop ``p``'s record (a runtime now owns its storage)."""
    _RECORDS.pop(p, None)
