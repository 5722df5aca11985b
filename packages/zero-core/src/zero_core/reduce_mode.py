"""What a reduction mode does with its pieces: where gradients are written, which collective a launch starts and
where its result goes. ``GradReducer`` (the driver: hooks, launch order, rounds) holds one mode, chosen from the
stage and the master store by ``zero_core.reducer.reduction_mode``:

=========================  =====================================================================================
:class:`AllReduceMode`     stage 0: persistent full gradients, each piece averaged in place (DDP)
``PersistentScatterMode``  stage 1: persistent full gradients, reduce-scattered at the accumulation boundary
``TransientScatterMode``   stages 2/3: a buffer per piece and round, reduce-scattered into the gradient shard
``UnitBatchMode``          stage 3, several ranks: units adjacent in flat and launch order reduced together
``StreamedMode``           stage 3 with a master store that keeps the gradients (NVMe): each result handed on
=========================  =====================================================================================

Every mode writes the shard this rank owns (``shards``), except the streamed one, which has none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from zero_comm.buffers import scratch
from zero_core.grad_reduction import GradComm
from zero_core.layout import Bucket, FlatGroup, ParamSlot
from zero_core.reduce_piece import ReductionPiece, ShardPart

if TYPE_CHECKING:
    from zero_core.reducer import GradReducer


class ReductionMode(ABC):
    """The part of the gradient reduction that differs by mode (base class: what every mode shares).

    Args:
        reducer: the driver; a mode appends to its ``in_flight`` / ``held`` lists and reports each finished piece
            to ``reducer.piece_reduced``.
        rt: the runtime (``precision``, ``config``, ``world``, ``comm_ctx``, ``master``, ``flat_groups``).
        comm: the bucket collective.
    """

    streamed = False
    """Each result is handed to the master store as it lands; no gradient shard (``GradReduction.streamed``)."""

    def __init__(self, reducer: GradReducer, rt, comm: GradComm) -> None:
        self.reducer, self.rt, self.comm = reducer, rt, comm
        self.reduce_dtype, self.accum_dtype = rt.precision.reduce, rt.precision.accum
        n = sum(len(g.buckets) for g in rt.flat_groups)
        self.shards: list[torch.Tensor | None] = [None] * len(rt.flat_groups)  # FlatGroup.index -> gradient shard
        self.grads: list[torch.Tensor | None] = [None] * n  # Bucket.index -> persistent buffer (stages 0/1)
        self.fresh = True  # every gradient shard is zero (nothing reduced since zero())
        self.batches: list = []  # stage 3's unit batches (``UnitBatchMode``; no other mode forms any)
        self._batched_for: tuple = ()  # the active pieces the batches were formed for

    # -- setting up ------------------------------------------------------------------------------------------------
    def allocate(self, groups: list[FlatGroup]) -> None:
        """Allocate the gradient shard of every trainable flat group (zeros, accumulation dtype)."""
        for g in groups:
            self.shards[g.index] = torch.zeros(g.shard_numel, dtype=self.accum_dtype, device=g.device)

    def _allocate_full(self, g: FlatGroup) -> torch.Tensor:
        """Stages 0/1: the full local gradient of ``g``, each bucket's buffer a view of it."""
        full = torch.zeros(g.padded_numel, dtype=self.accum_dtype, device=g.device)
        pos = 0
        for b in g.buckets:
            self.grads[b.index] = full[pos : pos + b.padded_numel]
            pos += b.padded_numel
        return full

    def _ddp_limit(self) -> int:
        """``reduce_bucket_size`` capped at the reducer's ``piece_bytes`` of the reduce dtype."""
        elem = torch.empty(0, dtype=self.reduce_dtype).element_size()
        return min(self.rt.config.reduce_bucket_size, max(1, self.reducer.piece_bytes // elem))

    def piece_limit(self) -> int | None:
        """Most elements per piece (None: one piece per bucket): stages 0-2 on several ranks cut each bucket into
        DDP-sized pieces; stage 3 reduces each unit whole (it is released as a whole)."""
        return self._ddp_limit() if self.rt.stage < 3 and self.rt.world > 1 else None

    def new_piece(self, pc: ReductionPiece, run: list[ParamSlot]) -> None:
        """Give a piece just cut (of the parameters ``run``) its send buffer (stages 0/1: a view of its bucket's
        persistent buffer)."""
        pc.buffer = self.grads[pc.bucket.index][pc.lo : pc.hi]

    def regroup(self, active: list[ReductionPiece]) -> None:
        """Form the unit batches for the pieces with hooked gradients, ``active`` (launch order), unless they were
        formed for these very pieces (``requires_grad`` may change between backwards)."""
        key = tuple(map(id, active))
        if key == self._batched_for:
            return
        for bt in self.batches:
            bt.disband()
        self.batches, self._batched_for = self._form_batches(active), key

    def _form_batches(self, active: list[ReductionPiece]) -> list:
        """The unit batches for ``active`` (none: each piece is reduced on its own)."""
        return []

    # -- backward --------------------------------------------------------------------------------------------------
    def write(self, pc: ReductionPiece, at: int, grad: torch.Tensor, first: bool) -> None:
        """Copy (``first``: the slot's first gradient since the buffer was cleared) or add ``grad`` into
        piece-local ``[at, at + grad.numel())``."""
        for view, src in self.views(pc, at, at + grad.numel(), grad.device):
            part = grad.reshape(-1)[src : src + view.numel()]
            view.copy_(part) if first else view.add_(part)

    def views(self, pc: ReductionPiece, lo: int, hi: int, device):
        """(buffer view, source offset) pairs covering piece-local ``[lo, hi)``; a transient buffer is taken from
        the pool on first use (after giving back those of completed reductions)."""
        if pc.buffer is None:
            self.reducer.give_back_completed()
            pc.buffer = scratch.take(pc.hi - pc.lo, self.reduce_dtype, device)
        return [(pc.buffer[lo:hi], 0)]

    def zero_unwritten(self, pc: ReductionPiece) -> None:
        """Make every element of the piece's buffer meaningful before it is sent: zero what no gradient was
        written into since the buffer was cleared."""
        if pc.clean:
            return
        for lo, hi in pc.unwritten():
            for view, _ in self.views(pc, lo, hi, pc.bucket.group.device):
                view.zero_()
        pc.written = {}
        pc.clean = not pc.transient

    def zero_idle(self, pc: ReductionPiece) -> None:
        """A persistent piece that will not be launched this round must still read as zero where logically zero."""
        self.zero_unwritten(pc)

    def _send(self, pc: ReductionPiece) -> torch.Tensor:
        """The piece's buffer in the reduce dtype (a copy only when the accumulation dtype differs)."""
        return pc.buffer if pc.buffer.dtype == self.reduce_dtype else pc.buffer.to(self.reduce_dtype)

    @abstractmethod
    def launch(self, pc: ReductionPiece) -> None:
        """Start the piece's collective (its buffer is fully written) and queue its finish."""

    def bucket_reduced(self, b: Bucket) -> None:
        """Every piece of ``b`` is in the shard: tell the master store."""
        self.rt.master.on_grad_ready(b, self.shards[b.group.index][b.shard_slice()], self.reducer.boundary)

    def round_finished(self) -> None:
        """Every reduction of the round is in the shards: the next one adds to them."""
        self.fresh = False

    # -- between steps ---------------------------------------------------------------------------------------------
    def zero(self, groups: list[FlatGroup], pieces: list[ReductionPiece]) -> None:
        """Drop the accumulated gradients (no collective is in flight)."""
        for g in groups:
            self.shards[g.index].zero_()
        self._forget(pieces)

    def _forget(self, pieces: list[ReductionPiece]) -> None:
        for pc in pieces:
            pc.written = {}
            if pc.transient:
                pc.give_back()
            else:  # logically zero: the first gradient of each slot is copied in, gaps zeroed at launch
                pc.clean = False
        self.fresh = True

    def resident(self, pieces: list[ReductionPiece]) -> list[torch.Tensor]:
        """The gradient shards and buffers held now."""
        held = [pc.buffer for pc in pieces if pc.transient]
        return [t for t in self.shards + self.grads + held if t is not None]

    def close(self, pieces: list[ReductionPiece]) -> None:
        """Let every buffer go."""
        self.shards, self.grads = [], []
        for pc in pieces:
            pc.buffer, pc.borrowed = None, False


class AllReduceMode(ReductionMode):
    """Stage 0 (DDP): the full local gradient is the accumulator (one partition); each piece is averaged in place
    at the accumulation boundary."""

    def allocate(self, groups: list[FlatGroup]) -> None:
        for g in groups:
            self.shards[g.index] = self._allocate_full(g)

    def launch(self, pc: ReductionPiece) -> None:
        send = self._send(pc)
        with self.rt.comm_ctx.on(self.rt.comm_ctx.reduce_stream):  # CUDA: off the compute stream
            handle = self.comm(send, send)
        pc.start(handle, send, pc.buffer, None)
        self.reducer.in_flight.append((pc, self._finish))

    def _finish(self, pc: ReductionPiece) -> None:
        if pc.out is not pc.dest:
            pc.dest.copy_(pc.out)
        pc.finished()
        self.reducer.piece_reduced(pc)

    def zero(self, groups: list[FlatGroup], pieces: list[ReductionPiece]) -> None:
        self._forget(pieces)  # the shard is the full buffer: cleared lazily, at launch


class ScatterMode(ReductionMode):
    """Stages 1-3: a piece is reduce-scattered; this rank receives its part (:class:`ShardPart`)."""

    def _scatter(self, pc: ReductionPiece, part: ShardPart, out: torch.Tensor):
        """Start the scattering collective of ``part`` into ``out`` (``part.numel`` elements): the bucket's own
        collective for a whole bucket, else ``comm.uneven`` (``zero_comm.reduce_scatter_uneven``)."""
        with self.rt.comm_ctx.on(self.rt.comm_ctx.reduce_stream):  # CUDA: off the compute stream
            if pc.whole and part.hi == pc.hi:
                return self.comm(out, part.send)
            return self.comm.uneven(out, part.send, part.splits(pc))

    def launch(self, pc: ReductionPiece) -> None:
        self._launch_into_shard(pc, ShardPart(pc, self._send(pc)))

    def _launch_into_shard(self, pc: ReductionPiece, part: ShardPart) -> None:
        """The result is added to the gradient shard (written straight into it by the first reduction since
        ``zero()``: no temporary, no add)."""
        shard = self.shards[pc.bucket.group.index][part.at : part.at + part.numel]
        direct = self.fresh and shard.dtype == self.reduce_dtype
        out = shard if direct else scratch.take(part.numel, self.reduce_dtype, part.send.device)
        pc.start(self._scatter(pc, part, out), out, shard, part)
        if pc.transient:
            self.reducer.held.append((pc, ReductionPiece.give_back))
        self.reducer.in_flight.append((pc, self._finish_into_shard))

    def _finish_into_shard(self, pc: ReductionPiece) -> None:
        if pc.out is not pc.dest:
            pc.dest.add_(pc.out)
            scratch.give(pc.out)
        pc.clean = False  # stage 1: the local gradients are consumed (logically zero from here)
        if pc.transient:
            pc.give_back()  # stages 2/3 keep only the shard
        pc.finished()
        self.reducer.piece_reduced(pc)


class TransientScatterMode(ScatterMode):
    """Stages 2/3: every round a piece takes a buffer from the pool, and gives it back once reduced into the shard;
    only the shard is kept."""

    def new_piece(self, pc: ReductionPiece, run: list[ParamSlot]) -> None:
        pc.transient, pc.clean = True, False

    def zero_idle(self, pc: ReductionPiece) -> None:
        """Nothing to clear: a transient buffer is written whole before it is sent."""
