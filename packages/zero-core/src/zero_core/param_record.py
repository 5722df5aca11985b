"""One record per parameter zero_core knows: what the parameter is to zero_core, in one weak table.

A :class:`ParamRecord` holds a parameter's ``ds_id`` (``zero_core.partitioned_param``), its partition while
``zero_init`` or ``defer_init`` holds it (:class:`PartitionedParam`, ``zero_core.partition_records``), where the
live runtime that claimed it laid it out (:class:`Place`, ``zero_core.registry``) and the marks taken when it was
partitioned. DeepSpeed keeps this state on attributes of the tensor; FSDP2 keeps one ``FSDPParam`` per parameter;
here the parameter object is the key, because DeepSpeed's APIs take a bare parameter.

Keyed weakly by the parameter object (``torch.utils.weak.WeakIdKeyDictionary``: O(1), identity, no ``id()`` reuse,
no record outliving its parameter). A record holds no parameter, and its runtime and stage-3 store only weakly, so
it keeps no layout or dropped runtime alive. This module imports nothing of zero_core: every reader sits above it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class PartitionedParam:
    """What a parameter partitioned at construction really is: ``shape``, ``numel``, ``dtype``, this rank's
    ``shard`` (``chunk`` elements of the zero-padded flat value), the process ``group`` and how many times it was
    partitioned; ``init`` for a deferred one (``zero_core.deferred_init``: ``init()`` gives the full value, no shard
    yet); ``built_dtype``: the dtype it was built in when ``zero_init(dtype=...)`` cast it (None: not cast)."""

    shape: torch.Size
    numel: int
    dtype: torch.dtype
    shard: torch.Tensor | None
    group: object
    partitions: int = 1
    init: object = None
    built_dtype: torch.dtype | None = None


class Place(NamedTuple):
    """Where a claimed parameter lives: its owner (a ``weakref.ref`` to a ``zero_core.registry.LayoutOwner``), the
    stage-3 store partitioning it (a ``weakref.ref``, or None) and its positions in the owner's layout."""

    owner: weakref.ref
    store: weakref.ref | None
    group: int  # position in owner.flat_groups
    bucket: int  # position in the group's buckets
    slot: int  # position in the bucket's slots


class ParamRecord:
    """Everything zero_core keeps about one parameter (see the module docstring); fields start empty."""

    __slots__ = ("ds_id", "partition", "place", "int8_if_frozen")

    def __init__(self) -> None:
        self.ds_id: int | None = None  # assigned once, where it is first partitioned (collective: same on every rank)
        self.partition: PartitionedParam | None = None  # until a runtime owns its storage
        self.place: Place | None = None  # set by a claim, cleared by its owner's release
        # partitioned by zero.Init(zero_quantized_nontrainable_weights=True): held as int8 by stage 3 while frozen
        self.int8_if_frozen = False


_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> its :class:`ParamRecord`."""


def record_of(p: torch.Tensor) -> ParamRecord | None:
    """``p``'s record, or None when zero_core never recorded anything about ``p``."""
    return _RECORDS.get(p)


def record_for(p: torch.Tensor) -> ParamRecord:
    """``p``'s record, created empty the first time."""
    rec = _RECORDS.get(p)
    if rec is None:
        rec = _RECORDS[p] = ParamRecord()
    return rec


def all_records() -> list[ParamRecord]:
    """Every live parameter's record (in no particular order)."""
    return list(_RECORDS.values())
