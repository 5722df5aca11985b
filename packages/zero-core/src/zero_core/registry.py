"""Which live runtime laid out a parameter, and where: zero's one parameter -> owner lookup.

Every runtime that lays parameters out in flat groups claims each of them when it is built (``ZeroRuntime`` at
every stage, whatever its parameter store: the default stores, zero_offload's, zero_compile's; a layout built
alone for tests of the compiled path) and releases them when it is closed. :func:`lookup` answers with a
:class:`ParamHandle`: the runtime, the flat group, bucket and slot, and the stage-3 store whose unit holds the
parameter where there is one. Readers: ``GatheredParameters``, ``register_external_parameter`` and the ``ds_*``
properties (the stage-3 unit), DeepSpeed's ``safe_get_*`` / ``safe_set_*`` in ``zero.utils`` (group and slot),
zero_compile's ``UnitStore`` (the bucket: its unit). DeepSpeed keeps this on attributes of the parameter; FSDP2
reaches it through the module; a bare parameter is what DeepSpeed's APIs take, hence a lookup by parameter.

A claim is the ``place`` of the parameter's one record (``zero_core.param_record``): weak in the parameter, its
runtime and its store, the place kept as positions, so it keeps no parameter, layout or dropped runtime alive. A
later claim of a parameter replaces the earlier one. The stage-3 store is reached through :class:`UnitHolder`, the
protocol declared here, so this module sits below the store.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from zero_core.layout import Bucket, FlatGroup, ParamSlot
from zero_core.param_record import Place, all_records, record_for, record_of
from zero_core.shard_state import ShardState, ZeroParamStatus


class LayoutOwner(Protocol):
    """What claims parameters: an object holding a flat-group layout (``ZeroRuntime``), weak-referenceable."""

    flat_groups: Sequence[FlatGroup]


class ParamReadout(Protocol):
    """What a stage-3 store answers about one parameter of its units, given the parameter's handle: the ``ds_*``
    properties of ``zero_core.partitioned_param.ZeroParameter``."""

    def param_status(self, handle: ParamHandle) -> ZeroParamStatus: ...

    def param_shape(self, handle: ParamHandle) -> torch.Size: ...

    def param_partition(self, handle: ParamHandle) -> torch.Tensor:
        """This rank's elements of the parameter (a flat tensor, possibly empty), in storage dtype."""
        ...


class UnitHolder(ParamReadout, Protocol):
    """A stage-3 store, as those who reach it through a parameter use it (``GatheredParameters``,
    ``gathered_for_compute``, ``register_external_parameter``, the ``ds_*`` properties); ``zero_core.stage3.Stage3``
    is one. Every method taking a unit is collective where it gathers: every rank calls it for the same units."""

    group: object  # the process group its units are gathered over

    def state_of(self, b: Bucket) -> ShardState: ...

    def gather(self, b: Bucket) -> None:
        """Materialise ``b`` now, the current phase's way (through qwZ/hpZ where configured)."""
        ...

    def gather_exact(self, b: Bucket) -> None:
        """Materialise ``b`` holding exactly its stored values (a plain all-gather, never a quantized copy)."""
        ...

    def release(self, b: Bucket, *, keep_views: bool = False) -> None:
        """Free ``b``'s full buffer unless it is persistent or held. ``keep_views``: tensors still viewing it (a
        user's, taken inside a ``GatheredParameters`` block) keep valid memory: the store drops its reference
        instead of freeing the storage under them."""
        ...

    def hold(self, b: Bucket) -> None:
        """Keep gathered ``b`` gathered (counted: blocks nest); module forwards leave it alone."""
        ...

    def unhold(self, b: Bucket) -> None: ...

    def full_of(self, b: Bucket) -> torch.Tensor:
        """``b``'s full buffer (``padded_numel`` elements, compute dtype)."""
        ...

    def write_shard(self, b: Bucket, chunk: torch.Tensor) -> None:
        """Store ``chunk`` (``b.chunk`` elements) as this rank's stored chunk of ``b``."""
        ...

    def before_write(self) -> None:
        """The stored shards are about to be written outside a step (collective)."""
        ...

    def shards_edited(self) -> None:
        """The stored shards were written outside a step (collective)."""
        ...

    def add_external(self, m: torch.nn.Module, b: Bucket) -> None:
        """``m``'s forward reads ``b``'s parameters though another module owns them."""
        ...


@dataclass(frozen=True, eq=False)
class ParamHandle:
    """Where one claimed parameter lives (built by :func:`lookup`; it holds its runtime only while kept).

    Attributes:
        owner: the runtime that laid the parameter out (a ``ZeroRuntime`` in an engine).
        group: its flat group (``owner.flat_groups[group.index]``).
        bucket: the bucket holding it; at stage 3 the unit gathered together.
        slot: its place in the flat group (``slot.param`` is the parameter, ``slot.name`` its name).
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
    store: UnitHolder | None

    @property
    def unit(self) -> tuple[UnitHolder, Bucket] | None:
        """``(stage-3 store, bucket)``: the unit to gather for the full value, or None when there is none."""
        return None if self.store is None else (self.store, self.bucket)


def claim(owner: LayoutOwner, store: UnitHolder | None = None) -> None:
    """Record ``owner`` (held weakly) as the holder of every parameter of its ``flat_groups``; ``store`` (held
    weakly): the stage-3 store partitioning them, or None. Replaces earlier claims of those parameters."""
    me = weakref.ref(owner)
    st = None if store is None else weakref.ref(store)
    for gi, g in enumerate(owner.flat_groups):
        for bi, b in enumerate(g.buckets):
            for si, s in enumerate(b.slots):
                if s.param is not None:
                    record_for(s.param).place = Place(me, st, gi, bi, si)


def _live(place: Place | None) -> tuple[LayoutOwner, UnitHolder | None] | None:
    """``(owner, store)`` of ``place`` while both are alive; None for no place or a dropped owner or store."""
    if place is None:
        return None
    owner = place.owner()
    store = None if place.store is None else place.store()
    if owner is None or (place.store is not None and store is None):
        return None
    return owner, store


def lookup(p: object) -> ParamHandle | None:
    """Where a live owner holds ``p``; None for anything else (another tensor, a non-tensor, a parameter whose
    owner was closed or dropped). O(1)."""
    if not isinstance(p, torch.Tensor):
        return None
    rec = record_of(p)
    place = None if rec is None else rec.place
    live = _live(place)
    if live is None:
        return None
    owner, store = live
    g = owner.flat_groups[place.group]
    b = g.buckets[place.bucket]
    return ParamHandle(owner, g, b, b.slots[place.slot], place.slot, store)


def stage3_unit(p: object) -> tuple[UnitHolder, Bucket] | None:
    """``(stage-3 store, unit)`` holding ``p``, or None when no live stage-3 store partitions it."""
    h = lookup(p)
    return None if h is None else h.unit


def release(owner: LayoutOwner) -> None:
    """Forget every parameter ``owner`` claimed (its runtime was closed), and claims of owners already gone."""
    for rec in all_records():
        held_by = None if rec.place is None else rec.place.owner()
        if rec.place is not None and (held_by is owner or held_by is None):
            rec.place = None


def size() -> int:
    """Number of parameters currently claimed by live owners (tests: closing runtimes must not grow it)."""
    return sum(_live(rec.place) is not None for rec in all_records())
