"""What the compiled path needs to know about the core's layout: units of whole parameters, padded to equal chunks.

A *unit* is what one all-gather fills (a ZeRO-3 unit) or what one reduce-scatter empties (a gradient bucket): the
parameters' flattened values back to back (``ParamSlot.offset``), padded at the end to ``padded_numel``, a
multiple of the world size; rank ``r`` owns elements ``[r * chunk, (r + 1) * chunk)``. This is the core's bucket
layout (``zero_core.layout.Bucket``), read once through a :class:`ShardSource` and frozen here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One parameter inside a unit: ``name`` (module's dotted name), ``offset``/``numel`` in elements into the
    unit's flat buffer, ``shape`` (the logical shape)."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Unit:
    """A gathered (ZeRO-3) or reduced (ZeRO-1) group of parameters: ``index``, ``padded_numel`` (elements, a
    multiple of the world size), ``slots`` in flat order."""

    index: int
    padded_numel: int
    slots: tuple[ParamSlot, ...]

    def chunk_numel(self, world: int) -> int:
        """Elements each rank owns (``padded_numel / world``)."""
        return self.padded_numel // world


@dataclass(frozen=True)
class CompiledLayout:
    """Every unit of a model, in the order the core built them (identical on every rank)."""

    units: tuple[Unit, ...]
    world: int
    rank: int

    def check(self) -> None:
        """ValueError naming the unit whose size or slots do not fit the padded-chunk layout."""
        for u in self.units:
            if u.padded_numel % self.world:
                raise ValueError(f"unit {u.index}: padded_numel {u.padded_numel} is not a multiple of the world "
                                 f"size {self.world}")  # fmt: skip
            end = max((s.offset + s.numel for s in u.slots), default=0)
            if end > u.padded_numel:
                raise ValueError(f"unit {u.index}: slot {u.slots[-1].name!r} ends at element {end}, beyond "
                                 f"padded_numel {u.padded_numel}")  # fmt: skip


class ShardSource(Protocol):
    """Where the compiled path reads parameter shards and writes reduced gradient shards (the core's seam).

    * ``layout``: the frozen :class:`CompiledLayout`.
    * ``params()``: ``(parameter, unit index, slot index)`` for every trainable or gathered parameter.
    * ``shard(unit)``: this rank's chunk of the unit's current parameter values, 1-D, ``chunk_numel`` elements of
      the storage dtype (read at each gather: it changes after each optimizer step).
    * ``add_grad_shard(unit, chunk, slots)``: add this rank's chunk of the rank-averaged gradient (1-D,
      ``chunk_numel``); ``slots`` are the unit's parameters that had a gradient.
    """

    layout: CompiledLayout

    def params(self) -> list[tuple[torch.nn.Parameter, int, int]]: ...

    def shard(self, unit: int) -> torch.Tensor: ...

    def add_grad_shard(self, unit: int, chunk: torch.Tensor, slots: list[int]) -> None: ...
