"""Stage 3 on several ranks with a plain reduce-scatter: units adjacent in their flat group and in launch order are
reduced together (a :class:`UnitBatch`, DeepSpeed's IPG bucket of ``reduce_bucket_size``, here also capped at DDP's
25 MiB): one reduce-scatter of a rank-major buffer whose part ``r`` is the units' chunks ``r`` side by side, so rank
``r`` receives one contiguous range of its shard. Gradients are written straight into their place in that buffer
(no copy at launch). Not with offload (memory comes first: a batch holds up to 25 MiB more in flight)."""

from __future__ import annotations

import torch

from zero_comm.buffers import scratch
from zero_core.layout import FlatGroup
from zero_core.reduce_mode import TransientScatterMode
from zero_core.reduce_piece import ReductionPiece


class UnitBatch:
    """Whole-unit pieces of one flat group, adjacent in flat order, reduced by one reduce-scatter.

    ``buffer`` (``partitions * stride`` elements of the reduce dtype, taken when the first gradient arrives) is
    rank-major: part ``r`` holds every member's chunk ``r``, member ``m``'s at ``offset[m]`` inside the part, in
    shard order, so rank ``r``'s result is its shard ``[first.shard_offset, first.shard_offset + stride)``.
    """

    def __init__(self, members: list[ReductionPiece]) -> None:
        self.members = members  # flat order (the reverse of launch order)
        self.stride = 0  # elements per rank: the members' chunks summed
        self.offset: dict[ReductionPiece, int] = {}  # member -> its chunk's start inside a rank's part
        self.buffer: torch.Tensor | None = None
        self.handle = None  # the reduce-scatter in flight
        self.out: torch.Tensor | None = None  # where it writes (the shard range, or a scratch buffer)
        self.dest: torch.Tensor | None = None  # the shard range
        for pc in members:
            self.offset[pc] = self.stride
            self.stride += pc.bucket.chunk
            pc.batch = self

    def views(self, pc: ReductionPiece, lo: int, hi: int):
        """(buffer view, source offset) for member ``pc``'s bucket-local elements ``[lo, hi)``, split at chunk
        boundaries (a parameter may straddle ranks' chunks)."""
        chunk = pc.bucket.chunk
        for r in range(lo // chunk, -(-hi // chunk)):
            a, e = max(lo, r * chunk), min(hi, (r + 1) * chunk)
            at = r * self.stride + self.offset[pc] + a - r * chunk
            yield self.buffer[at : at + e - a], a - lo

    def start(self, handle, out: torch.Tensor, dest: torch.Tensor) -> None:
        """Record the reduce-scatter just started for the batch."""
        self.handle, self.out, self.dest = handle, out, dest

    def finished(self) -> None:
        """Drop the references of the completed reduce-scatter."""
        self.handle = self.out = self.dest = None

    def give_back(self) -> None:
        """The buffer goes back to the pool (the reduce-scatter has completed, or nothing was written)."""
        if self.buffer is not None:
            scratch.give(self.buffer)
            self.buffer = None

    def disband(self) -> None:
        """The members are reduced on their own from now on."""
        self.give_back()
        for pc in self.members:
            pc.batch = None


class UnitBatchMode(TransientScatterMode):
    """Stage 3 with unit batches (see the module docstring); a unit in no batch is reduced on its own."""

    def _form_batches(self, active: list[ReductionPiece]) -> list[UnitBatch]:
        """Runs of active whole-unit pieces, adjacent in launch order and in their flat group, up to
        ``reduce_bucket_size`` and the reducer's ``piece_bytes``."""
        batches = []
        limit = self._ddp_limit()
        run: list[ReductionPiece] = []
        size = 0  # elements of ``run``
        for pc in active + [None]:
            prev = run[-1].bucket if run else None
            if pc is not None and prev is not None and pc.bucket.group is prev.group \
                    and pc.bucket.index == prev.index - 1 and size + pc.bucket.padded_numel <= limit:  # fmt: skip
                run.append(pc)
                size += pc.bucket.padded_numel
                continue
            if len(run) > 1:
                batches.append(UnitBatch(run[::-1]))
            run, size = ([pc], pc.bucket.padded_numel) if pc is not None else ([], 0)
        return batches

    def views(self, pc: ReductionPiece, lo: int, hi: int, device):
        bt = pc.batch
        if bt is None:
            return super().views(pc, lo, hi, device)
        if bt.buffer is None:
            self.reducer.give_back_completed()
            bt.buffer = scratch.take(pc.bucket.group.partitions * bt.stride, self.reduce_dtype, device)
        return bt.views(pc, lo, hi)

    def launch(self, pc: ReductionPiece) -> None:
        if pc.batch is None:
            super().launch(pc)
        elif pc is pc.batch.members[0]:  # launch order is the reverse of flat order: the first member launches last
            self._launch_batch(pc.batch)

    def _launch_batch(self, bt: UnitBatch) -> None:
        """Every member is launched (their gaps zeroed): one reduce-scatter of the rank-major buffer into this
        rank's contiguous shard range of the members."""
        first = bt.members[0].bucket
        shard = self.shards[first.group.index][first.shard_offset : first.shard_offset + bt.stride]
        direct = self.fresh and shard.dtype == self.reduce_dtype
        out = shard if direct else scratch.take(bt.stride, self.reduce_dtype, bt.buffer.device)
        with self.rt.comm_ctx.on(self.rt.comm_ctx.reduce_stream):  # CUDA: off the compute stream
            handle = self.comm(out, bt.buffer)
        bt.start(handle, out, shard)
        self.reducer.held.append((bt, UnitBatch.give_back))
        self.reducer.in_flight.append((bt, self._finish_batch))

    def _finish_batch(self, bt: UnitBatch) -> None:
        if bt.out is not bt.dest:
            bt.dest.add_(bt.out)
            scratch.give(bt.out)
        bt.give_back()
        bt.finished()
        for pc in bt.members:
            self.reducer.piece_reduced(pc)

    def zero(self, groups: list[FlatGroup], pieces: list[ReductionPiece]) -> None:
        for g in groups:
            self.shards[g.index].zero_()
        for bt in self.batches:
            bt.give_back()
        self._forget(pieces)

    def resident(self, pieces: list[ReductionPiece]) -> list[torch.Tensor]:
        return super().resident(pieces) + [bt.buffer for bt in self.batches if bt.buffer is not None]

    def close(self, pieces: list[ReductionPiece]) -> None:
        super().close(pieces)
        for bt in self.batches:
            bt.buffer = None
