"""Which live runtime laid out a parameter, and where: zero's one parameter -> owner lookup.

Every runtime that lays parameters out in flat groups claims each of them when it is built (``ZeroRuntime`` at
every stage, whatever its parameter store: the default stores, zero_offload's, zero_compile's; a layout built
alone for tests of the compiled path) and releases them when it is closed. :func:`lookup` answers with a
:class:`ParamHandle`: the runtime, the flat group, bucket and slot, and the stage-3 store whose unit holds the
parameter where there is one. Readers: ``GatheredParameters``, ``register_external_parameter`` and the ``ds_*``
properties (the stage-3 unit), DeepSpeed's ``safe_get_*`` / ``safe_set_*`` in ``zero.utils`` (group and slot),
zero_compile's ``UnitStore`` (the bucket: its unit). DeepSpeed keeps this on attributes of the parameter; FSDP2
reaches it through the module; a bare parameter is what DeepSpeed's APIs take, hence a lookup by parameter.

Keyed weakly by the parameter object (``torch.utils.weak.WeakIdKeyDictionary``: O(1), no ``id()`` reuse, no entry
outliving its parameter). An entry holds its runtime and stage-3 store weakly and the place as positions, so it
keeps no parameter, layout or dropped runtime alive. A later claim of a parameter replaces the earlier one.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from zero_core.layout import Bucket, FlatGroup, ParamSlot

if TYPE_CHECKING:
    from zero_core.stage3 import Stage3


class LayoutOwner(Protocol):
    """What claims parameters: an object holding a flat-group layout (``ZeroRuntime``), weak-referenceable."""

    flat_groups: Sequence[FlatGroup]


@dataclass(frozen=True, eq=False)
class ParamHandle:
    """Where one claimed parameter lives (built by :func:`lookup`; it holds its runtime only while kept).

    Attributes:
        owner: the runtime that laid the parameter out (a ``ZeroRuntime`` in an engine).
        group: its flat group (``owner.flat_groups[group.index]``).
        bucket: the bucket holding it; at stage 3 the unit gathered together.
        slot: its place in the flat group (``slot.param`` is the parameter).
        slot_index: its position in ``bucket.slots``.
        store: the stage-3 store partitioning ``bucket`` (gathers it, answers ``ds_*``); None where the
            parameter is whole between uses (stages 0-2) or its store is not zero_core's stage 3 (the compiled
            path's graphs gather it).
    """

    owner: LayoutOwner
    group: FlatGroup
    bucket: Bucket
    slot: ParamSlot
    slot_index: int
    store: Stage3 | None

    @property
    def unit(self) -> tuple[Stage3, Bucket] | None:
        """``(stage-3 store, bucket)``: the unit to gather for the full value, or None when there is none."""
        return None if self.store is None else (self.store, self.bucket)


class _Place(NamedTuple):
    owner: weakref.ref
    store: weakref.ref | None
    group: int  # position in owner.flat_groups
    bucket: int  # position in the group's buckets
    slot: int  # position in the bucket's slots


_PLACES: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> its :class:`_Place`."""
_OWNERS: weakref.WeakSet = weakref.WeakSet()
"""owners holding claims now."""


def claim(owner: LayoutOwner, store: Stage3 | None = None) -> None:
    """Record ``owner`` (held weakly) as the holder of every parameter of its ``flat_groups``; ``store`` (held
    weakly): the stage-3 store partitioning them, or None. Replaces earlier claims of those parameters."""
    me = weakref.ref(owner)
    st = None if store is None else weakref.ref(store)
    for gi, g in enumerate(owner.flat_groups):
        for bi, b in enumerate(g.buckets):
            for si, s in enumerate(b.slots):
                if s.param is not None:
                    _PLACES[s.param] = _Place(me, st, gi, bi, si)
    _OWNERS.add(owner)


def lookup(p: object) -> ParamHandle | None:
    """Where a live owner holds ``p``; None for anything else (another tensor, a non-tensor, a parameter whose
    owner was closed or dropped). O(1)."""
    if not isinstance(p, torch.Tensor):
        return None
    place = _PLACES.get(p)
    if place is None:
        return None
    owner = place.owner()
    store = None if place.store is None else place.store()
    if owner is None or (place.store is not None and store is None):
        return None
    g = owner.flat_groups[place.group]
    b = g.buckets[place.bucket]
    return ParamHandle(owner, g, b, b.slots[place.slot], place.slot, store)


def stage3_unit(p: object) -> tuple[Stage3, Bucket] | None:
    """``(stage-3 store, unit)`` holding ``p``, or None when no live stage-3 store partitions it."""
    h = lookup(p)
    return None if h is None else h.unit


def owners() -> list[LayoutOwner]:
    """The live owners holding claims now (in no particular order)."""
    return list(_OWNERS)


def release(owner: LayoutOwner) -> None:
    """Forget every parameter ``owner`` claimed (its runtime was closed), and entries of owners already gone."""
    for p, place in list(_PLACES.items()):
        held_by = place.owner()
        if held_by is owner or held_by is None:
            _PLACES.pop(p, None)
    _OWNERS.discard(owner)


def size() -> int:
    """Number of parameters currently claimed (tests: closing runtimes must not grow it)."""
    return len(_PLACES)
