"""``SwapRing``: the host memory an NVMe-offloaded step moves its sub-groups through, as one ring of bytes.

DeepSpeed's swappers cut their pool into ``buffer_count`` slots of ``sub_group_size`` elements each, one sub-group
per slot. Sub-groups end at parameter boundaries, so most are far smaller than a slot: on the 20m Llama 57 of 90
sub-groups per rank hold under 100k elements, and slots sized for 4M elements left the pool nearly empty while the
step waited for a slot. Here the same bytes (``buffer_count`` x the largest sub-group) are one ring, and each
sub-group takes only the room it needs, in step order: as many reads as fit run ahead (during backward, see
``NVMeOptimizer``), and writes stay in flight after the step until their room is needed again.

Room is handed out in ring order and given back in the same order, so the regions in use form one arc: ``place``
waits for the oldest released regions' I/O (a write, or a read that was dropped) until the new region is clear,
and returns None when a region whose data has not been used yet (not released) is in the way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from zero_kernels.aio import AioError, AsyncIO, aligned_empty


@dataclass(eq=False)
class Region:
    """Room for one sub-group: elements ``[start, start + numel)`` of the ring.

    Attributes:
        sg: index of the sub-group it holds.
        handle: the read or write in flight on it (``AsyncIO`` handle), None when none is.
        released: its data has been used (stepped and its write started, or dropped): the room may be reused
            once ``handle`` has finished.
    """

    sg: int
    start: int
    numel: int
    handle: int | None = None
    released: bool = False


class SwapRing:
    """One aligned fp32 host buffer of ``numel`` elements handed out as regions, in ring order.

    Args:
        numel: elements of the ring (``NVMeOptimizer``: ``buffer_count`` x segments x one buffer, capped at every
            sub-group at once).
        io: the engine that reads and writes the regions.

    A read of a sub-group first waits for that sub-group's pending write (the only one that can still change
    its file), wherever in the ring that write came from.
    """

    def __init__(self, numel: int, io: AsyncIO):
        self.buf = aligned_empty(numel) if numel else torch.empty(0)
        self.numel, self.io = numel, io
        self._head = 0
        self._live: deque[Region] = deque()  # placed and not yet reused, oldest first
        self._writes: dict[int, Region] = {}  # sub-group -> the region its newest write came from

    def view(self, r: Region, offset: int = 0, numel: int | None = None) -> torch.Tensor:
        """Elements ``[offset, offset + numel)`` of region ``r`` (all of it from ``offset`` by default)."""
        end = r.start + (r.numel if numel is None else offset + numel)
        return self.buf[r.start + offset : end]

    def settle(self, r: Region) -> None:
        """Wait for the I/O in flight on ``r`` (raises its AioError, naming file, offset and size)."""
        if r.handle is not None:
            h, r.handle = r.handle, None
            self.io.wait(h)

    def place(self, sg: int, numel: int) -> Region | None:
        """Room for ``numel`` elements of sub-group ``sg`` after the newest region (at the ring's start when the
        end is too near). Waits for the oldest released regions in the way; None when an unreleased one is.

        Raises:
            ValueError: ``numel`` exceeds the ring.
        """
        if numel > self.numel:
            raise ValueError(f"swap ring of {self.numel} elements cannot hold a sub-group region of {numel}")
        start = self._head if self._head + numel <= self.numel else 0
        while any(r.start < start + numel and start < r.start + r.numel for r in self._live):
            oldest = self._live[0]
            if not oldest.released:
                return None
            self.settle(oldest)
            self._live.popleft()
            if self._writes.get(oldest.sg) is oldest:
                del self._writes[oldest.sg]
        r = Region(sg, start, numel)
        self._live.append(r)
        self._head = start + numel
        return r

    def read(self, r: Region, path: str, offset: int) -> None:
        """Start reading ``r.numel`` elements of ``path`` from byte ``offset`` into ``r``, after the pending write
        of the same sub-group (if any) has landed."""
        pending = self._writes.pop(r.sg, None)
        if pending is not None:
            self.settle(pending)
        r.handle = self.io.read(self.view(r), path, offset)

    def write(self, r: Region, numel: int, path: str, offset: int) -> None:
        """Start writing the first ``numel`` elements of ``r`` to ``path`` at byte ``offset`` and release ``r``
        (its room is reused once the write has landed)."""
        self.settle(r)
        older = self._writes.get(r.sg)
        if older is not None and older is not r:  # two writes of one file range in flight could land out of order
            self.settle(older)
        r.handle = self.io.write(self.view(r, 0, numel), path, offset)
        r.released = True
        self._writes[r.sg] = r

    def release(self, r: Region) -> None:
        """Give ``r`` back without writing it (a read that is no longer wanted stays waited for before reuse)."""
        r.released = True

    def release_all(self) -> None:
        """Give back every region (a step that failed midway: its reads in flight are still waited for before
        their room is reused)."""
        for r in self._live:
            r.released = True

    def drain(self) -> None:
        """Wait for every read and write in flight and forget every region: the whole ring is free again."""
        first = None
        for r in self._live:  # every one, even after a failure: none may land in reused room later
            try:
                self.settle(r)
            except AioError as e:
                first = first or e
        self._live.clear()
        self._writes.clear()
        self._head = 0
        if first is not None:
            raise first

    def pending(self) -> int:
        """Regions whose read or write has not been waited for."""
        return sum(r.handle is not None for r in self._live)
