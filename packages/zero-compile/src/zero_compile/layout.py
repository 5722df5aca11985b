"""What the compiled path reads of the core's layout: units of whole parameters, padded to equal chunks.

A *unit* is what one all-gather fills (a ZeRO-3 unit) or what one reduce-scatter empties (a gradient bucket): the
core's frozen ``zero_core.layout.Bucket`` itself (``slots`` with ``bucket_offset``/``numel``/``shape``, padded to
``padded_numel``, a multiple of the world size; rank ``r`` owns elements ``bucket.chunk_range(r)``). There is no
second model of it here: :class:`CompiledLayout` only lists the buckets the compiled path handles, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from zero_core.layout import Bucket


@dataclass(frozen=True)
class CompiledLayout:
    """The core's buckets the compiled path gathers or reduces, in the order the core built them (identical on
    every rank); unit ``i`` is ``units[i]``."""

    units: tuple[Bucket, ...]
    world: int
    rank: int

    def check(self) -> None:
        """ValueError naming the unit whose size or slots do not fit the padded-chunk layout."""
        for i, u in enumerate(self.units):
            if u.padded_numel % self.world or u.chunk * self.world != u.padded_numel:
                raise ValueError(f"unit {i}: padded_numel {u.padded_numel} is not {self.world} chunks of {u.chunk}")
            end = max((s.bucket_offset + s.numel for s in u.slots), default=0)
            if end > u.padded_numel:
                raise ValueError(f"unit {i}: slot {u.slots[-1].name!r} ends at element {end}, beyond "
                                 f"padded_numel {u.padded_numel}")  # fmt: skip


class ShardSource(Protocol):
    """Where the compiled path reads parameter shards and writes reduced gradient shards (the core's seam).

    * ``layout``: the frozen :class:`CompiledLayout`. Its buckets' parameters are claimed in
      ``zero_core.registry`` by whoever laid them out (``ZeroRuntime``; a source building its own layout claims
      it), which is how the store tells a parameter's unit and slot.
    * ``shard(unit)``: this rank's chunk of the unit's current parameter values, 1-D, ``bucket.chunk`` elements of
      the storage dtype (read at each gather: it changes after each optimizer step).
    * ``add_grad_shard(unit, chunk, slots, offset=0, ready=True)``: add a part of this rank's chunk of the
      rank-averaged gradient (1-D, at most ``bucket.chunk`` elements) at element ``offset`` of the chunk; ``slots``
      are the unit's parameters that had a gradient; ``ready``: the last part of the unit in this reduction.
    * ``reduce_dtype``: the dtype gradients are reduced in; None: each gradient's own dtype.
    """

    layout: CompiledLayout
    reduce_dtype: torch.dtype | None

    def shard(self, unit: int) -> torch.Tensor: ...

    def add_grad_shard(
        self, unit: int, chunk: torch.Tensor, slots: list[int], *, offset: int = 0, ready: bool = True
    ) -> None: ...
