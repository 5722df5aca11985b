"""``UnitWriter``: the NVMe step's new values go straight into stage 3's parameter store, one unit at a time.

With optimizer state on NVMe and ``offload_param`` at stage 3 (ZeRO-Infinity), no host copy of the updated shard
is kept: :class:`~zero_offload.nvme_optimizer.NVMeOptimizer` hands each stepped sub-group's fp32 values to
:meth:`UnitWriter.take`, which gathers a unit's sub-groups (they end at unit boundaries and are stepped in order)
straight into the store's buffer for that unit (``open_chunk``/``close_chunk``: a swap buffer under
``offload_param: nvme``, written to the unit's swap file once its last sub-group arrived). The same object gives
the optimizer its starting masters unit by unit (``source``), so no whole shard is ever in host memory. Host
memory: none of its own during steps (one fp32 chunk of a unit while ``source`` serves the start-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from zero_core.layout import Bucket, FlatGroup


class UnitChunks(Protocol):
    """What :class:`UnitWriter` uses of an offloaded stage-3 parameter store (zero_offload's host and NVMe
    stores): this rank's chunk of each unit (``b.chunk`` elements, storage dtype)."""

    def read_chunk(self, b: Bucket) -> torch.Tensor:
        """The stored chunk of unit ``b`` (valid until the next ``read_chunk``)."""
        ...

    def open_chunk(self, b: Bucket, keep: bool) -> torch.Tensor:
        """Unit ``b``'s chunk to fill in place (``keep``: it starts with the stored values)."""
        ...

    def close_chunk(self, b: Bucket) -> None:
        """Store the chunk ``open_chunk(b)`` gave."""
        ...

    def flush(self) -> None:
        """Wait until every chunk written is stored."""
        ...


class UnitWriter:
    """See the module docstring.

    Args:
        chunks: where the offloaded stage-3 store keeps each unit's chunk (:class:`UnitChunks`: its storage
            policy, ``ParamStore.offloaded_chunks()``); the step writes the new values straight into it.
        groups: the trainable flat groups in master-shard order (shard ``i`` is ``groups[i]``).

    Attributes:
        writes: unit chunks written by steps.

    Raises (``take``/``finish``):
        RuntimeError: a unit's sub-groups arrived out of order or incompletely (a bug, never silent).
    """

    def __init__(self, chunks: UnitChunks, groups: Sequence[FlatGroup]):
        self.chunks, self.groups = chunks, groups
        self.writes = 0
        self._unit: dict[int, Bucket] = {}  # sub-group index -> its unit (bucket)
        self._left: dict[Bucket, int] = {}  # unit -> sub-groups still to come this step
        self._partial: set[Bucket] = set()  # units with a sub-group not stepped this step (their values kept)
        self._current: Bucket | None = None  # the unit being filled
        self._dst: torch.Tensor | None = None  # the store's buffer of the unit being filled
        self._cached = (None, None)  # (unit, its fp32 chunk) for ``source``

    def options(self) -> dict:
        """NVMeOptimizer's keyword arguments for this mode."""
        return {"stream_grads": True, "param_sink": self.take, "source": self.source,
                "numels": [g.shard_numel for g in self.groups]}  # fmt: skip

    def _bucket_at(self, shard: int, start: int):
        for b in self.groups[shard].buckets:
            if b.shard_offset <= start < b.shard_offset + b.chunk:
                return b
        raise RuntimeError(f"UnitWriter: shard {shard} has no unit at element {start}")

    @torch.no_grad()
    def source(self, shard: int, start: int, end: int) -> torch.Tensor:
        """fp32 starting values of elements ``[start, end)`` of master shard ``shard`` (inside one unit)."""
        b = self._bucket_at(shard, start)
        if self._cached[0] is not b:
            self._cached = (b, self.chunks.read_chunk(b).to(torch.float32, copy=True))
        chunk = self._cached[1]
        return chunk[start - b.shard_offset : end - b.shard_offset]

    def begin(self, skip: frozenset[int], sub_groups) -> None:
        """Before a step: which sub-groups each unit will receive (``skip``: not stepped this time)."""
        self._cached = (None, None)
        if not self._unit:
            self._unit = {sg.index: self._bucket_at(sg.shard, sg.start) for sg in sub_groups}
        self._left, self._partial = {}, set()
        for sg in sub_groups:
            b = self._unit[sg.index]
            if sg.index in skip:
                self._partial.add(b)
            else:
                self._left[b] = self._left.get(b, 0) + 1
        self._current = None

    @torch.no_grad()
    def take(self, sg, values: torch.Tensor) -> None:
        """Sub-group ``sg``'s new fp32 values; a unit whose last sub-group arrived is written to the store."""
        b = self._unit[sg.index]
        if b is not self._current:
            if self._current is not None:
                raise RuntimeError(f"UnitWriter: unit {self._current.index} incomplete when sub-group {sg.index} came")
            self._current = b
            # some of its parameters are not stepped (partial): their stored values are kept
            self._dst = self.chunks.open_chunk(b, keep=b in self._partial)
        off = sg.start - b.shard_offset
        self._dst[off : off + sg.numel].copy_(values)
        self._left[b] -= 1
        if self._left[b] == 0:
            self._dst = None
            self.chunks.close_chunk(b)
            self.writes += 1
            self._current = None

    def finish(self) -> None:
        """After a step: every unit written (the store's writes waited for)."""
        if self._current is not None:
            raise RuntimeError(f"UnitWriter: unit {self._current.index} incomplete at the end of the step")
        self.chunks.flush()
