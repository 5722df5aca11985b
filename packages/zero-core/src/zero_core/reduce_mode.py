"""What a reduction mode does with its pieces: where gradients are written, which collective a launch starts and
where its result lands. ``GradReducer`` (the driver: hooks, launch order, rounds, the queue of reductions in
flight) holds one mode, chosen from the stage and the master store by ``zero_core.reducer.reduction_mode``:

=========================  =====================================================================================
:class:`AllReduceMode`     stage 0: persistent full gradients, each piece averaged in place (DDP)
``PersistentScatterMode``  stage 1: persistent full gradients, reduce-scattered at the accumulation boundary
``TransientScatterMode``   stages 2/3: a buffer per piece and round, reduce-scattered into the gradient shard
``UnitBatchMode``          stage 3, several ranks: units adjacent in flat and launch order reduced together
``StreamedMode``           stage 3 with a master store that keeps the gradients (NVMe): each result handed on
=========================  =====================================================================================

This module holds the base and the modes of stages 0, 2 and 3 (the table's first, third and fourth);
``reduce_persistent`` holds stage 1's mode, ``reduce_streamed`` the NVMe one.

A mode's ``launch`` starts a piece's collective and returns a :class:`Reduction` (the collective in flight and how
its result lands); the reducer queues it and calls its ``finish`` (wait, then land). Every mode writes the shard
this rank owns (``shards``), except the streamed one, which has none.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from zero_comm import plan_buckets
from zero_comm.buffers import scratch
from zero_core.comm_context import CommContext, StreamJoin
from zero_core.grad_reduction import GradComm
from zero_core.layout import Bucket, FlatGroup, ParamSlot
from zero_core.precision import PrecisionPolicy
from zero_core.reduce_piece import ReductionPiece, ShardPart, UnitBatch


class GradSink(Protocol):
    """What the modes use of the master store: where a bucket's reduced gradient goes (``zero_core.master``)."""

    watches_grads: bool
    """``on_grad_ready`` does work (a store that copies or steps each reduced gradient as it lands); False: it is
    not called for a bucket reduced into the gradient shard (the store reads the shard at ``step``)."""

    def on_grad_ready(
        self, bucket: Bucket, grad_shard: torch.Tensor, boundary: bool | None, start: int | None = None
    ) -> None: ...


class Reduction:
    """A started collective of the reducer's queue: ``handle`` (``wait()``, ``ready()``), the pieces it completes
    (the reducer counts them off their buckets) and, in subclasses, where its result lands.

    Args:
        handle: the collective's handle (``zero_comm.CommHandle``).
        pieces: the pieces whose reduction it completes (none: the result goes straight to the master store).
        pooled: it holds a buffer of the scratch pool that :meth:`give_back` can return as soon as the collective
            has completed, before :meth:`finish` runs.
    """

    __slots__ = ("handle", "pieces", "pooled", "told")

    lands_aside = False
    """:meth:`land_aside` can land the result on a side stream right after the launch (else it lands in
    :meth:`finish`)."""

    def __init__(self, handle, pieces: tuple[ReductionPiece, ...], pooled: bool) -> None:
        self.handle, self.pieces, self.pooled = handle, pieces, pooled
        self.told = False  # the reducer has told the mode of its pieces already (landed aside)

    def finish(self, boundary: bool | None) -> None:
        """Wait for the collective, then land its result (``boundary`` as the round's, for the master store)."""
        self.handle.wait()

    def land_aside(self) -> None:
        """With ``lands_aside``: the collective has been waited for on the current (side) stream: land the result
        there; :meth:`finish` then only gives the buffers back (the reducer makes ``handle`` join that stream)."""

    def give_back(self) -> None:
        """The collective has completed: the pooled send buffer goes back (the next piece takes it again)."""


class ReductionMode(ABC):
    """The part of the gradient reduction that differs by mode (base class: what every mode shares).

    Args:
        flat_groups: every flat group of the layout (``FlatGroup.index`` order); the trainable ones get shards.
        precision: ``reduce`` (what collectives send) and ``accum`` (gradient shards) dtypes.
        comm: the bucket collective.
        comm_ctx: the collective streams (CUDA: reductions launched off the compute stream).
        master: the master store's gradient side.
        piece_limit: most elements per reduction piece (None: one piece per bucket).
    """

    streamed = False
    """Each result is handed to the master store as it lands; no gradient shard (``GradReduction.streamed``)."""
    clears_idle = False
    """Persistent buffers: a piece not launched in a round must still be zeroed where no gradient was written."""
    one_in_flight = False
    """At most one reduction in flight: the reducer finishes the last before launching the next."""
    lands_early: bool
    """The reducer lands each reduction as soon as it has completed (polled at every launch) rather than at the end
    of backward: the master store watches the gradients, so it gets each one while backward goes on."""

    def __init__(self, *, flat_groups: list[FlatGroup], precision: PrecisionPolicy, comm: GradComm,
                 comm_ctx: CommContext, master: GradSink, piece_limit: int | None) -> None:  # fmt: skip
        self.master, self.piece_limit = master, piece_limit
        # the reducer calls bucket_reduced only when it does work: here, telling a master store that watches
        self.reports_buckets = master.watches_grads
        self.lands_early = master.watches_grads and not self.one_in_flight
        self.reduce, self.uneven = comm.reduce, comm.uneven  # the bucket collectives (read once: the hot path)
        self.comm_ctx = comm_ctx
        self.reduce_stream = comm_ctx.reduce_stream  # CUDA: launch off the compute stream; None: launch in place
        self.reduce_dtype, self.accum_dtype = precision.reduce, precision.accum
        n = sum(len(g.buckets) for g in flat_groups)
        self.grads: list[torch.Tensor | None] = [None] * n  # Bucket.index -> persistent buffer (stages 0/1)
        self.fresh = True  # every gradient shard is zero (nothing reduced since zero())
        self.batches: list = []  # stage 3's unit batches (``UnitBatchMode``; no other mode forms any)
        self._batched_for: tuple = ()  # the active pieces the batches were formed for
        self.trainable = [g for g in flat_groups if g.group_index is not None]
        # FlatGroup.index -> gradient shard (None: frozen; stages 0/1: views of ``grads``)
        self.shards: list[torch.Tensor | None] = self._allocate(len(flat_groups))

    # -- setting up ------------------------------------------------------------------------------------------------
    def _allocate(self, count: int) -> list[torch.Tensor | None]:
        """The gradient shard of every trainable flat group (zeros, accumulation dtype), by ``FlatGroup.index``
        (``count`` groups)."""
        shards: list[torch.Tensor | None] = [None] * count
        for g in self.trainable:
            shards[g.index] = torch.zeros(g.shard_numel, dtype=self.accum_dtype, device=g.device)
        return shards

    def _allocate_full(self, g: FlatGroup) -> torch.Tensor:
        """Stages 0/1: the full local gradient of ``g``, each bucket's buffer a view of it."""
        full = torch.zeros(g.padded_numel, dtype=self.accum_dtype, device=g.device)
        pos = 0
        for b in g.buckets:
            self.grads[b.index] = full[pos : pos + b.padded_numel]
            pos += b.padded_numel
        return full

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
        piece-local ``[at, at + grad.numel())``; a transient buffer is taken from the pool on first use."""
        buf = pc.buffer
        if buf is None:
            buf = pc.buffer = scratch.take(pc.hi - pc.lo, self.reduce_dtype, grad.device)
        view = buf[at : at + grad.numel()]
        view.copy_(grad.reshape(-1)) if first else view.add_(grad.reshape(-1))

    def _zero_gaps(self, pc: ReductionPiece) -> None:
        """Make every element of the piece's buffer meaningful before it is sent: zero what no gradient was written
        into since the buffer was cleared."""
        if pc.clean:
            return
        gaps = pc.unwritten()
        if gaps:
            buf = pc.buffer
            if buf is None:  # nothing written at all (every gradient of the piece missing this round)
                buf = pc.buffer = scratch.take(pc.hi - pc.lo, self.reduce_dtype, pc.bucket.group.device)
            for lo, hi in gaps:
                buf[lo:hi].zero_()
        pc.written = {}
        pc.clean = not pc.transient

    def zero_idle(self, pc: ReductionPiece) -> None:
        """A persistent piece that will not be launched this round must still read as zero where logically zero."""
        self._zero_gaps(pc)

    def _send(self, pc: ReductionPiece) -> torch.Tensor:
        """The piece's buffer in the reduce dtype (a copy only when the accumulation dtype differs)."""
        return pc.buffer if pc.buffer.dtype == self.reduce_dtype else pc.buffer.to(self.reduce_dtype)

    @abstractmethod
    def launch(self, pc: ReductionPiece) -> Reduction | None:
        """Zero the piece's unwritten elements and start its collective; returns the reduction for the reducer's
        queue (None: the piece waits for others, e.g. the rest of its unit batch)."""

    def bucket_reduced(self, b: Bucket, boundary: bool | None) -> None:
        """Every piece of ``b`` is in the shard: tell the master store. Called by the reducer only when
        ``reports_buckets``, for a bucket reduced in one piece."""
        self.master.on_grad_ready(b, self.shards[b.group.index][b.shard_offset : b.shard_offset + b.chunk], boundary)

    def piece_reduced(self, pc: ReductionPiece, boundary: bool | None, last: bool) -> None:
        """Piece ``pc`` of a bucket reduced in several is in the shard: tell the master store of this rank's part of
        it (``start=``: its shard offset; nothing when the piece lies outside this rank's chunk). ``last``: the
        bucket's last piece. Called by the reducer only when ``reports_buckets``."""
        at, numel = pc.part_range()
        if numel:
            self.master.on_grad_ready(pc.bucket, self.shards[pc.bucket.group.index][at : at + numel], boundary,
                                      start=at)  # fmt: skip

    def round_finished(self) -> None:
        """Every reduction of the round is in the shards: the next one adds to them."""
        self.fresh = False

    # -- between steps ---------------------------------------------------------------------------------------------
    def zero(self, pieces: list[ReductionPiece]) -> None:
        """Drop the accumulated gradients (no collective is in flight)."""
        for g in self.trainable:
            self.shards[g.index].zero_()
        self._forget(pieces)

    def _forget(self, pieces: list[ReductionPiece]) -> None:
        for pc in pieces:
            pc.written = {}
            if pc.transient:
                if pc.buffer is not None:
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


class InPlaceReduction(Reduction):
    """Stage 0: the piece averaged in place (copied back when it was sent in another dtype)."""

    __slots__ = ("out", "dest")

    def __init__(self, handle, pc: ReductionPiece, out: torch.Tensor, dest: torch.Tensor) -> None:
        super().__init__(handle, (pc,), False)
        self.out, self.dest = out, dest

    def finish(self, boundary: bool | None) -> None:
        self.handle.wait()
        if self.out is not self.dest:
            self.dest.copy_(self.out)


class AllReduceMode(ReductionMode):
    """Stage 0 (DDP): the full local gradient is the accumulator (one partition); each piece is averaged in place
    at the accumulation boundary."""

    clears_idle = True

    def _allocate(self, count: int) -> list[torch.Tensor | None]:
        shards: list[torch.Tensor | None] = [None] * count
        for g in self.trainable:
            shards[g.index] = self._allocate_full(g)
        return shards

    def launch(self, pc: ReductionPiece) -> Reduction:
        self._zero_gaps(pc)
        send = self._send(pc)
        if self.reduce_stream is None:
            handle = self.reduce(send, send)
        else:
            with self.comm_ctx.on(self.reduce_stream) as event:  # CUDA: off the compute stream
                handle = StreamJoin(self.reduce(send, send), event, self.comm_ctx)
        return InPlaceReduction(handle, pc, send, pc.buffer)

    def zero(self, pieces: list[ReductionPiece]) -> None:
        self._forget(pieces)  # the shard is the full buffer: cleared lazily, at launch


class ShardReduction(Reduction):
    """A piece reduce-scattered into this rank's gradient shard: ``out`` (the shard range itself, or a scratch
    buffer added into it, ``dest``)."""

    __slots__ = ("out", "dest", "pc", "landed")

    lands_aside = True

    def __init__(self, handle, pc: ReductionPiece, out: torch.Tensor, dest: torch.Tensor) -> None:
        super().__init__(handle, (pc,), pc.transient)
        self.out, self.dest, self.pc = out, dest, pc
        self.landed = False  # added into the shard already, on a side stream (land_aside)

    def land_aside(self) -> None:
        if self.out is not self.dest:
            self.dest.add_(self.out)  # ``out`` goes back in finish, once the compute stream has joined
        self.landed = True

    def finish(self, boundary: bool | None) -> None:
        self.handle.wait()
        if self.out is not self.dest:
            if not self.landed:
                self.dest.add_(self.out)
            scratch.give(self.out)
        pc = self.pc
        pc.clean = False  # stage 1: the local gradients are consumed (logically zero from here)
        if pc.transient:
            pc.give_back()  # stages 2/3 keep only the shard

    def give_back(self) -> None:
        self.handle.wait()  # completes at once; runs the all-to-all's sum, which reads the receive buffer
        self.pc.give_back()


class ScatterMode(ReductionMode):
    """Stages 1-3: a piece is reduce-scattered; this rank receives its part (:class:`ShardPart`)."""

    def _scatter(self, pc: ReductionPiece, part: ShardPart, out: torch.Tensor):
        """Start the scattering collective of ``part`` into ``out`` (``part.numel`` elements): the bucket's own
        collective for a whole bucket, else ``comm.uneven`` (``zero_comm.reduce_scatter_uneven``)."""
        if self.reduce_stream is None:
            if pc.whole and part.hi == pc.hi:
                return self.reduce(out, part.send)
            return self.uneven(out, part.send, part.splits(pc))
        with self.comm_ctx.on(self.reduce_stream) as event:  # CUDA: off the compute stream
            if pc.whole and part.hi == pc.hi:
                handle = self.reduce(out, part.send)
            else:
                handle = self.uneven(out, part.send, part.splits(pc))
        return StreamJoin(handle, event, self.comm_ctx)  # the result is read where the reduce stream is joined

    def launch(self, pc: ReductionPiece) -> Reduction:
        self._zero_gaps(pc)
        return self._into_shard(pc, ShardPart(pc, self._send(pc)))

    def _into_shard(self, pc: ReductionPiece, part: ShardPart) -> Reduction:
        """The result is added to the gradient shard (written straight into it by the first reduction since
        ``zero()``: no temporary, no add)."""
        shard = self.shards[pc.bucket.group.index][part.at : part.at + part.numel]
        direct = self.fresh and shard.dtype == self.reduce_dtype
        out = shard if direct else scratch.take(part.numel, self.reduce_dtype, part.send.device)
        return ShardReduction(self._scatter(pc, part, out), pc, out, shard)


class TransientScatterMode(ScatterMode):
    """Stages 2/3: every round a piece takes a buffer from the pool, and gives it back once reduced into the shard;
    only the shard is kept."""

    def new_piece(self, pc: ReductionPiece, run: list[ParamSlot]) -> None:
        pc.transient, pc.clean = True, False

    def zero_idle(self, pc: ReductionPiece) -> None:
        """Nothing to clear: a transient buffer is written whole before it is sent."""


class BatchReduction(Reduction):
    """One reduce-scatter of a unit batch into this rank's shard range of its members (``out``: that range itself,
    or a scratch buffer added into it, ``dest``)."""

    __slots__ = ("batch", "out", "dest")

    def __init__(self, handle, bt: UnitBatch, out: torch.Tensor, dest: torch.Tensor) -> None:
        self.handle, self.pieces, self.pooled, self.told = handle, bt.pieces, True, False  # (``Reduction``'s fields)
        self.batch, self.out, self.dest = bt, out, dest

    def finish(self, boundary: bool | None) -> None:
        self.handle.wait()
        if self.out is not self.dest:
            self.dest.add_(self.out)
            scratch.give(self.out)
        bt = self.batch
        if bt.buffer is not None:  # back to the pool (as UnitBatch.give_back)
            scratch.give(bt.buffer)
            bt.buffer = None

    def give_back(self) -> None:
        self.handle.wait()  # completes at once; runs the all-to-all's sum, which reads the receive buffer
        self.batch.give_back()


class UnitBatchMode(TransientScatterMode):
    """Stage 3 on several ranks with a plain reduce-scatter: units adjacent in their flat group and in launch order
    are reduced together (a ``reduce_piece.UnitBatch``, DeepSpeed's IPG bucket of ``reduce_bucket_size``, here also
    capped at DDP's 25 MiB; the runs are cut by ``zero_comm.plan_buckets``): one reduce-scatter of a rank-major
    buffer whose part ``r`` is the units' chunks ``r`` side by side, so rank ``r`` receives one contiguous range of
    its shard. Gradients are written straight into their place in that buffer (no copy at launch). A unit in no
    batch is reduced on its own. Not with offload (memory first: a batch holds up to 25 MiB more in flight).

    Args: as ``ReductionMode``, and ``batch_limit``: most elements per batch (``reduce_bucket_size`` capped at the
    reducer's bytes per piece of the reduce dtype).
    """

    def __init__(self, *, flat_groups: list[FlatGroup], precision: PrecisionPolicy, comm: GradComm,
                 comm_ctx: CommContext, master: GradSink, piece_limit: int | None,
                 batch_limit: int) -> None:  # fmt: skip
        super().__init__(flat_groups=flat_groups, precision=precision, comm=comm, comm_ctx=comm_ctx, master=master,
                         piece_limit=piece_limit)  # fmt: skip
        self.batch_limit = batch_limit

    def _form_batches(self, active: list[ReductionPiece]) -> list[UnitBatch]:
        """Runs of active whole-unit pieces, adjacent in launch order and in their flat group, of at most
        ``batch_limit`` elements (filled in launch order; a run of one unit is no batch)."""
        batches = []
        run: list[ReductionPiece] = []  # adjacent pieces, launch order
        for pc in active + [None]:
            prev = run[-1].bucket if run else None
            if pc is not None and prev is not None and pc.bucket.group is prev.group \
                    and pc.bucket.index == prev.index - 1:  # fmt: skip
                run.append(pc)
                continue
            for cut in plan_buckets([p.bucket.padded_numel for p in run], self.batch_limit):
                if len(cut) > 1:
                    batches.append(UnitBatch(run[cut.start : cut.stop][::-1]))
            run = [pc] if pc is not None else []
        return batches

    def write(self, pc: ReductionPiece, at: int, grad: torch.Tensor, first: bool) -> None:
        bt = pc.batch
        if bt is None:
            return super().write(pc, at, grad, first)
        buf = bt.buffer
        if buf is None:
            buf = bt.buffer = scratch.take(pc.bucket.group.partitions * bt.stride, self.reduce_dtype, grad.device)
        flat = grad.reshape(-1)
        for lo, hi, src in bt.runs[pc][at]:
            view = buf[lo:hi]
            view.copy_(flat[src : src + hi - lo]) if first else view.add_(flat[src : src + hi - lo])

    def launch(self, pc: ReductionPiece) -> Reduction | None:
        bt = pc.batch
        if bt is None:
            return super().launch(pc)
        if not pc.clean:  # zero what no gradient was written (the padding, missing gradients)
            gaps = pc.padding if len(pc.written) == pc.slots else pc.unwritten()
            if gaps:
                if bt.buffer is None:
                    bt.buffer = scratch.take(pc.bucket.group.partitions * bt.stride, self.reduce_dtype,
                                             pc.bucket.group.device)  # fmt: skip
                for lo, hi in gaps:
                    for a, e, _ in bt.views(pc, lo, hi):
                        bt.buffer[a:e].zero_()
            pc.written = {}
        if pc is not bt.members[0]:  # launch order is the reverse of flat order: the first member launches last
            return None
        # every member is launched (their gaps zeroed): one reduce-scatter of the rank-major buffer into this
        # rank's contiguous shard range of the members
        first = pc.bucket
        shard = self.shards[first.group.index][first.shard_offset : first.shard_offset + bt.stride]
        out = shard if self.fresh and shard.dtype == self.reduce_dtype else scratch.take(bt.stride, self.reduce_dtype,
                                                                                          bt.buffer.device)  # fmt: skip
        if self.reduce_stream is None:
            handle = self.reduce(out, bt.buffer)
        else:
            with self.comm_ctx.on(self.reduce_stream) as event:  # CUDA: off the compute stream
                handle = StreamJoin(self.reduce(out, bt.buffer), event, self.comm_ctx)
        return BatchReduction(handle, bt, out, shard)

    def zero(self, pieces: list[ReductionPiece]) -> None:
        for g in self.trainable:
            self.shards[g.index].zero_()
        for bt in self.batches:
            if bt.buffer is not None:
                bt.give_back()
        self._forget(pieces)

    def resident(self, pieces: list[ReductionPiece]) -> list[torch.Tensor]:
        return super().resident(pieces) + [bt.buffer for bt in self.batches if bt.buffer is not None]

    def close(self, pieces: list[ReductionPiece]) -> None:
        super().close(pieces)
        for bt in self.batches:
            bt.buffer = None
