"""Stage 1: persistent full local gradients, reduce-scattered when a backward is the accumulation boundary (or at
``step()``). A flat group of one bucket keeps its gradient shard inside the full buffer (this rank's chunk of it:
the ZeRO memory formula), so the reduced result lands on the rank's own part of the send buffer, and a value
reduced in an earlier round is moved aside before new local gradients are added there."""

from __future__ import annotations

import torch

from zero_comm.buffers import scratch
from zero_core.comm_context import CommContext
from zero_core.grad_reduction import GradComm
from zero_core.layout import Bucket, FlatGroup
from zero_core.precision import PrecisionPolicy
from zero_core.reduce_mode import GradSink, Reduction, ScatterMode
from zero_core.reduce_piece import ReductionPiece, ShardPart


class OwnChunkReduction(Reduction):
    """A piece of a bucket whose shard is this rank's chunk of the full gradient buffer: the result is written
    there (in place, or copied from ``out``), then a value stashed from an earlier round is added back."""

    __slots__ = ("out", "dest", "pc", "part", "stashed")

    def __init__(self, handle, pc: ReductionPiece, out: torch.Tensor, dest: torch.Tensor, part: ShardPart,
                 stashed: dict[Bucket, torch.Tensor]) -> None:  # fmt: skip
        super().__init__(handle, (pc,), False)
        self.out, self.dest, self.pc, self.part = out, dest, pc, part
        self.stashed = stashed  # the mode's reduced values moved aside, by bucket (read when the result lands)

    def finish(self, boundary: bool | None) -> None:
        self.handle.wait()
        pc, part = self.pc, self.part
        pc.clean = False  # the local gradients are consumed: logically zero (the shard is written next)
        if self.out is not self.dest:
            self.dest.copy_(self.out)
            scratch.give(self.out)
        stash = self.stashed.get(pc.bucket)
        if stash is not None:
            self.dest.add_(stash[part.a - part.base : part.e - part.base])


class PersistentScatterMode(ScatterMode):
    """Stage 1 (see the module docstring); a flat group of several buckets reduces into a shard of its own.
    Arguments as ``ReductionMode``."""

    clears_idle = True

    def __init__(self, *, flat_groups: list[FlatGroup], precision: PrecisionPolicy, comm: GradComm,
                 comm_ctx: CommContext, master: GradSink, piece_limit: int | None) -> None:  # fmt: skip
        self.own_chunk: set[Bucket] = set()  # buckets whose shard is a view of their full gradient
        self.reduced: set[Bucket] = set()  # ... whose own chunk holds a reduced (not local) value
        self.stashed: dict[Bucket, torch.Tensor] = {}  # reduced values moved aside for a further round
        super().__init__(flat_groups=flat_groups, precision=precision, comm=comm, comm_ctx=comm_ctx, master=master,
                         piece_limit=piece_limit)  # allocates (below), filling own_chunk  # fmt: skip
        self.reports_buckets = True  # bucket_reduced marks an own chunk reduced, whether the master watches or not

    def _allocate(self, count: int) -> list[torch.Tensor | None]:
        shards = super()._allocate(count)
        for g in self.trainable:
            self._allocate_full(g)
            if len(g.buckets) == 1:  # ZeRO formula: the shard is this rank's chunk of the full buffer
                b = g.buckets[0]
                shards[g.index] = self.grads[b.index][slice(*b.chunk_range(g.rank))]
                self.own_chunk.add(b)
        return shards

    def write(self, pc: ReductionPiece, at: int, grad: torch.Tensor, first: bool) -> None:
        self._stash(pc.bucket)
        super().write(pc, at, grad, first)

    def _stash(self, b: Bucket) -> None:
        """Before new local gradients land on a chunk that holds an already reduced value, move that value aside
        (added back when the next round finishes)."""
        if b not in self.reduced:
            return
        self.reduced.discard(b)
        own = self.shards[b.group.index]
        if b in self.stashed:
            self.stashed[b].add_(own)
        else:
            self.stashed[b] = own.clone()
        own.zero_()

    def launch(self, pc: ReductionPiece) -> Reduction:
        self._zero_gaps(pc)
        part = ShardPart(pc, self._send(pc))
        if pc.bucket not in self.own_chunk:
            return self._into_shard(pc, part)
        shard = self.shards[pc.bucket.group.index][part.at : part.at + part.numel]
        self._stash(pc.bucket)
        # the reduced part lands on this rank's own part of the send buffer: in place when the dtypes allow
        # (the collective reads its input before it writes the output, as NCCL's in-place reduce-scatter)
        in_place = part.send is pc.buffer and shard.dtype == self.reduce_dtype
        out = shard if in_place else scratch.take(part.numel, self.reduce_dtype, part.send.device)
        return OwnChunkReduction(self._scatter(pc, part, out), pc, out, shard, part, self.stashed)

    def bucket_reduced(self, b: Bucket, boundary: bool | None) -> None:
        self._own_reduced(b)
        super().bucket_reduced(b, boundary)

    def piece_reduced(self, pc: ReductionPiece, boundary: bool | None, last: bool) -> None:
        if last:
            self._own_reduced(pc.bucket)
        super().piece_reduced(pc, boundary, last)

    def _own_reduced(self, b: Bucket) -> None:
        """``b`` is reduced: an own chunk holds a reduced value from now on (its stash was added back)."""
        if b in self.own_chunk:
            self.stashed.pop(b, None)
            self.reduced.add(b)

    def zero_idle(self, pc: ReductionPiece) -> None:
        """Not a bucket whose own chunk holds a reduced value: that stays until it is stashed or stepped."""
        if pc.bucket not in self.reduced:
            self._zero_gaps(pc)

    def zero(self, pieces: list[ReductionPiece]) -> None:
        for g in self.trainable:
            if not any(b in self.own_chunk for b in g.buckets):
                self.shards[g.index].zero_()  # (else the shard is part of the full buffer, cleared lazily)
        self._forget(pieces)
        self.reduced.clear()
        self.stashed.clear()
