"""Stage 1: persistent full local gradients, reduce-scattered when a backward is the accumulation boundary (or at
``step()``). A flat group of one bucket keeps its gradient shard inside the full buffer (this rank's chunk of it:
the ZeRO memory formula), so the reduced result lands on the rank's own part of the send buffer, and a value
reduced in an earlier round is moved aside before new local gradients are added there."""

from __future__ import annotations

import torch

from zero_comm.buffers import scratch
from zero_core.layout import Bucket, FlatGroup
from zero_core.reduce_mode import ScatterMode
from zero_core.reduce_piece import ReductionPiece, ShardPart


class PersistentScatterMode(ScatterMode):
    """Stage 1 (see the module docstring); a flat group of several buckets reduces into a shard of its own."""

    def __init__(self, reducer, rt, comm) -> None:
        super().__init__(reducer, rt, comm)
        self.own_chunk: set[Bucket] = set()  # buckets whose shard is a view of their full gradient
        self.reduced: set[Bucket] = set()  # ... whose own chunk holds a reduced (not local) value
        self.stashed: dict[Bucket, torch.Tensor] = {}  # reduced values moved aside for a further round

    def allocate(self, groups: list[FlatGroup]) -> None:
        super().allocate(groups)
        for g in groups:
            self._allocate_full(g)
            if len(g.buckets) == 1:  # ZeRO formula: the shard is this rank's chunk of the full buffer
                b = g.buckets[0]
                self.shards[g.index] = self.grads[b.index][slice(*b.chunk_range(g.rank))]
                self.own_chunk.add(b)

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

    def launch(self, pc: ReductionPiece) -> None:
        part = ShardPart(pc, self._send(pc))
        if pc.bucket in self.own_chunk:
            self._launch_own_chunk(pc, part)
        else:
            self._launch_into_shard(pc, part)

    def _launch_own_chunk(self, pc: ReductionPiece, part: ShardPart) -> None:
        """The shard is this rank's chunk of the full gradient buffer: the result is written there."""
        shard = self.shards[pc.bucket.group.index][part.at : part.at + part.numel]
        self._stash(pc.bucket)
        # the reduced part lands on this rank's own part of the send buffer: in place when the dtypes allow
        # (the collective reads its input before it writes the output, as NCCL's in-place reduce-scatter)
        in_place = part.send is pc.buffer and shard.dtype == self.reduce_dtype
        out = shard if in_place else scratch.take(part.numel, self.reduce_dtype, part.send.device)
        pc.start(self._scatter(pc, part, out), out, shard, part)
        self.reducer.in_flight.append((pc, self._finish_own_chunk))

    def _finish_own_chunk(self, pc: ReductionPiece) -> None:
        pc.clean = False  # the local gradients are consumed: logically zero (the shard is written next)
        if pc.out is not pc.dest:
            pc.dest.copy_(pc.out)
            scratch.give(pc.out)
        if pc.bucket in self.stashed:
            a, e = pc.part.a - pc.part.base, pc.part.e - pc.part.base
            pc.dest.add_(self.stashed[pc.bucket][a:e])
        pc.finished()
        self.reducer.piece_reduced(pc)

    def bucket_reduced(self, b: Bucket) -> None:
        if b in self.own_chunk:
            self.stashed.pop(b, None)
            self.reduced.add(b)
        super().bucket_reduced(b)

    def zero_idle(self, pc: ReductionPiece) -> None:
        """Not a bucket whose own chunk holds a reduced value: that stays until it is stashed or stepped."""
        if pc.bucket not in self.reduced:
            self.zero_unwritten(pc)

    def zero(self, groups: list[FlatGroup], pieces: list[ReductionPiece]) -> None:
        for g in groups:
            if not any(b in self.own_chunk for b in g.buckets):
                self.shards[g.index].zero_()  # (else the shard is part of the full buffer, cleared lazily)
        self._forget(pieces)
        self.reduced.clear()
        self.stashed.clear()
