"""Gradient reduction: per-parameter hooks fill reduction pieces; a complete piece launches its collective.

Stage 0 all-reduces (average) each piece; stages 1-3 reduce-scatter it, each rank adding its chunk into its
gradient shard (``grad_shard(g)``, the optimizer's ``.grad``). Pieces launch strictly in one fixed order (the order
backward normally produces them), so every rank issues the same collectives in the same order even when ranks use
different parameters: a piece whose gradients are not all ready when backward ends is launched anyway, its missing
gradients counting as zero (DeepSpeed's treatment of unused parameters).

A layout bucket is reduced in *pieces* (reduction buckets, DDP's buckets; ``reduce_piece.ReductionPiece``):
contiguous runs of whole parameters of at most ``reduce_bucket_size`` elements and DDP's 25 MiB
(:data:`DDP_BUCKET_BYTES`), cut by ``zero_comm.plan_buckets`` (the planner zero-comm's bucketed collectives use),
each launched as soon as its last gradient is in, so reductions overlap the rest of backward while the layout keeps
one bucket per flat group (a rank's shard stays one contiguous range, which the fp32 master aliases: the ZeRO
memory formula). A piece smaller than its bucket is reduced with ``zero_comm.reduce_scatter_uneven``: summed over a
bucket, the bytes of one reduce-scatter. Stage 3 reduces each unit whole, several adjacent units together on
several ranks (``reduce_mode.UnitBatchMode``).

A master store that watches the gradients (ZeRO-Offload's copy to the host, SuperOffload's speculative step) gets
each reduced bucket, or each piece of a bucket reduced in several, while backward goes on: with streams the
reduction lands on the copy stream right after its launch, ordered after it alone (the store's copies queue behind
it there); without, as soon as it is polled complete (at every launch); on one rank its stage 0-2 buckets are cut
into DDP-sized pieces too, so the first ones arrive before backward ends.

Stages 2 and 3 reduce every backward (micro-batch) and keep only the shard. Stages 0 and 1 keep the full local
gradient and reduce only when a backward is marked as the accumulation boundary, or at ``step()`` otherwise; nothing
a backward produced is ever dropped (reductions are linear: reducing several times before one step gives the sum).

:class:`GradReducer` is the driver every mode shares (hooks, pieces, launch order, rounds, and the queue of
reductions in flight); what differs by mode (where a gradient is written, which collective a launch starts, where
its result lands) is a ``reduce_mode.ReductionMode`` chosen by :func:`reduction_mode`: its ``launch`` returns a
``reduce_mode.Reduction`` that the reducer queues and finishes, as Megatron-core's bucket group drives its buckets.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from torch.profiler import record_function

from zero_comm import plan_buckets
from zero_core.comm_context import CommContext, StreamJoin
from zero_core.grad_reduction import GradComm, ReductionInputs, default_grad_comm
from zero_core.layout import Bucket, FlatGroup
from zero_core.precision import PrecisionPolicy
from zero_core.reduce_mode import AllReduceMode, GradSink, Reduction, ReductionMode, TransientScatterMode, UnitBatchMode
from zero_core.reduce_persistent import PersistentScatterMode
from zero_core.reduce_piece import BucketRound, ReductionPiece
from zero_core.reduce_streamed import StreamedMode

# DDP's default bucket_cap_mb: a reduction piece holds at most this many bytes of the reduce dtype.
DDP_BUCKET_BYTES = 25 * 2**20


class ReductionParams(Protocol):
    """What the reducer uses of the parameter store (``zero_core.param_store.ParamStore``)."""

    def before_reduce(self) -> None:
        """A reduction is about to be launched (stage 3 settles its gathers' order check first)."""
        ...

    def on_grads_done(self, bucket: Bucket) -> None:
        """Every hooked gradient of ``bucket`` has arrived this round (stage 3 releases the unit)."""
        ...


class ReductionMaster(GradSink, Protocol):
    """What choosing the mode reads of the master store, besides what the modes use of it."""

    takes_grad_shards: bool
    """Stage 3: the store keeps the gradients itself (streamed); the reduction then holds no shard."""


def reduction_mode(*, stage: int, world: int, comm: GradComm, master: ReductionMaster, flat_groups: list[FlatGroup],
                   precision: PrecisionPolicy, comm_ctx: CommContext, reduce_bucket_size: int, piece_bytes: int,
                   offloads: bool) -> ReductionMode:  # fmt: skip
    """The mode for the stage and master store (see ``zero_core.reduce_mode``).

    Args:
        stage, world: the ZeRO stage and the data-parallel group's size.
        comm: the bucket collective; master: the master store.
        flat_groups, precision, comm_ctx: the layout, dtypes and collective streams.
        reduce_bucket_size: most elements per reduction piece (and per stage-3 unit batch).
        piece_bytes: most bytes (of the reduce dtype) per piece or batch on more than one rank (DDP's 25 MiB).
        offloads: an offload is configured (stage 3 then reduces one unit per reduce-scatter: memory first).

    Raises:
        ValueError: ``comm`` does not fit the stage (stage 0 averages whole buffers in place; stages 1-3 need a
            collective that scatters).
    """
    if comm.scatters != (stage > 0):
        want = "a scattering collective (reduce-scatter)" if stage else "an all-reduce (scatters False)"
        raise ValueError(f"GradReducer: stage {stage} needs {want} as comm, got {type(comm).__name__}")
    ddp_limit = min(reduce_bucket_size, max(1, piece_bytes // precision.reduce.itemsize))
    # stages 0-2 on several ranks cut each bucket into DDP-sized pieces, and on one rank too for a master store that
    # watches the gradients (each piece goes to it as it lands, during backward, not the whole bucket at its end);
    # stage 3 reduces each unit whole (it is released as a whole), except streamed: runs of reduce_bucket_size, so a
    # unit's gradient need not be held whole
    limit = ddp_limit if stage < 3 and (world > 1 or master.watches_grads) else None
    args = dict(flat_groups=flat_groups, precision=precision, comm=comm, comm_ctx=comm_ctx, master=master)
    if stage == 0:
        return AllReduceMode(**args, piece_limit=limit)
    if stage == 1:
        return PersistentScatterMode(**args, piece_limit=limit)
    if stage == 3 and master.takes_grad_shards:
        return StreamedMode(**args, piece_limit=reduce_bucket_size if comm.takes_pieces else None)
    if stage == 3 and world > 1 and comm.joins_units and not offloads:
        return UnitBatchMode(**args, piece_limit=limit, batch_limit=ddp_limit)
    return TransientScatterMode(**args, piece_limit=limit)


class GradReducer:
    """Owns the gradient hooks, reduction pieces, rounds and the queue of reductions in flight of one runtime (see
    the module docstring); implements ``zero_core.grad_reduction.GradReduction``.

    Args:
        mode: what the stage and master store make of each piece (:func:`reduction_mode`).
        flat_groups: the layout; the trainable groups' buckets are cut into pieces and their parameters hooked.
        stage: the ZeRO stage (2/3 reduce every backward; 0/1 at the accumulation boundary).
        params: the parameter store, told before each launch and when a bucket's gradients are all in.

    Build it with :meth:`from_inputs` (what ``ZeroRuntime`` does).
    """

    def __init__(self, *, mode: ReductionMode, flat_groups: list[FlatGroup], stage: int,
                 params: ReductionParams) -> None:  # fmt: skip
        self.mode = mode
        self.params = params
        self.every_backward = stage >= 2  # stages 2/3 reduce every backward; 0/1 at the boundary
        self.streamed = mode.streamed  # see GradReduction.streamed
        self.clears_idle, self.one_in_flight = mode.clears_idle, mode.one_in_flight  # read once: the mode's kind
        self.reports_buckets = mode.reports_buckets  # each bucket reduced is told to the mode (else nobody listens)
        self.lands_early = mode.lands_early  # ... as it lands, during backward (polled at each launch, never waited)
        # with streams, such a reduction lands on the copy stream right after its launch, after it alone
        self.aside = mode.comm_ctx if mode.comm_ctx.active else None
        self.groups = [g for g in flat_groups if g.group_index is not None]  # the trainable flat groups
        self.slots = [s for g in self.groups for s in g.slots]  # hooked by index into this list
        self.pieces: list[ReductionPiece] = []  # in launch order
        self.rounds: list[BucketRound] = []  # each layout bucket with parameters: its counts, shared by its pieces
        # per slot (index into ``slots``): its piece, its piece-local offset, (flat group index, index in the group)
        self.slot_piece: list[ReductionPiece] = []
        self.slot_at: list[int] = []
        self.slot_flag: list[tuple[int, int]] = [(g.index, i) for g in self.groups for i in range(len(g.slots))]
        self.trainable: list[bool] = [False] * len(self.slots)  # requires_grad as last hooked
        self.active: list[ReductionPiece] = []  # the pieces with hooked gradients, in launch order
        self._hooks: dict[int, object] = {}  # slot index -> hook handle (kept so close() removes them)
        # per round (reset by zero() / a round's end)
        self.next_launch = 0  # the next piece of ``active`` to launch
        self.reduce_now = self.every_backward  # reductions launch during backward (2/3, or a stage-1 boundary)
        self.boundary: bool | None = None
        self.dirty = False  # some gradient arrived since the last completed round
        self.in_flight: list[Reduction] = []  # the reductions started, in launch order
        self.held: list[Reduction] = []  # ... of them holding a pooled buffer not given back yet
        self.got: dict[int, list[bool]] = {g.index: [False] * len(g.slots) for g in self.groups}
        self._cut_pieces()
        self._hook_trainable()

    @classmethod
    def from_inputs(cls, inputs: ReductionInputs, *, comm: GradComm | None = None,
                    piece_bytes: int = DDP_BUCKET_BYTES) -> GradReducer:  # fmt: skip
        """The reducer for a runtime (``ZeroRuntime``'s default ``grad_reduction`` builder; pass
        ``functools.partial(GradReducer.from_inputs, comm=..., piece_bytes=...)`` for other settings).

        Args:
            inputs: what the runtime offers.
            comm: the bucket collective (``zero_core.grad_reduction.GradComm``); None: chosen from the config by
                ``default_grad_comm``.
            piece_bytes: on more than one rank, most bytes (of the reduce dtype) per reduction piece (stages 0-2)
                or per batch of units (stage 3), on top of ``reduce_bucket_size`` (elements); default DDP's 25 MiB.

        Raises:
            ValueError: ``piece_bytes`` is not positive; ``comm`` does not fit the stage.
        """
        if piece_bytes <= 0:
            raise ValueError(f"GradReducer: piece_bytes must be a positive byte count, got {piece_bytes}")
        cfg = inputs.config
        if comm is None:
            comm = default_grad_comm(stage=inputs.stage, group=inputs.group, world=inputs.world, overlap=cfg.overlap,
                                     zeropp=inputs.zeropp)  # fmt: skip
        mode = reduction_mode(stage=inputs.stage, world=inputs.world, comm=comm, master=inputs.master,
                              flat_groups=list(inputs.flat_groups), precision=inputs.precision,
                              comm_ctx=inputs.comm_ctx, reduce_bucket_size=cfg.reduce_bucket_size,
                              piece_bytes=piece_bytes, offloads=cfg.offloads)  # fmt: skip
        return cls(mode=mode, flat_groups=list(inputs.flat_groups), stage=inputs.stage, params=inputs.params)

    def grad_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of ``g`` (None for a frozen group, or after ``close()``)."""
        shards = self.mode.shards
        return shards[g.index] if g.index < len(shards) else None

    def resident(self) -> list[torch.Tensor]:
        """The gradient shards and gradient buffers held now (stages 2/3: pieces not yet reduced)."""
        return self.mode.resident(self.pieces)

    def _cut_pieces(self) -> None:
        """Pieces of every bucket with parameters, in launch order (backward meets the last parameters first)."""
        limit = self.mode.piece_limit
        piece_of: dict[int, ReductionPiece] = {}  # id(slot) -> its piece
        for g in self.groups:
            for b in g.buckets:
                if not b.slots:
                    continue
                bucket_round = BucketRound(b)
                self.rounds.append(bucket_round)
                slots = list(b.slots)
                runs = [slots[r.start : r.stop] for r in plan_buckets([s.numel for s in slots], limit)] if limit \
                    else [slots]  # fmt: skip
                for i, run in enumerate(runs):
                    lo = 0 if i == 0 else run[0].bucket_offset
                    hi = b.padded_numel if i == len(runs) - 1 else runs[i + 1][0].bucket_offset
                    covered = [(s.bucket_offset - lo, s.bucket_offset - lo + s.numel) for s in run]
                    piece = ReductionPiece(b, bucket_round, lo, hi, min(s.param_index for s in run), covered)
                    self.mode.new_piece(piece, run)
                    piece_of.update((id(s), piece) for s in run)
                    self.pieces.append(piece)
        # Backward meets a piece's first parameter last, so that order launches each piece as soon as it is
        # complete. By last parameter, a piece spread over the model (stage 3's persistent norms, a no-decay group's
        # biases) would be first in line and hold every later launch (and, streamed, every unit's gradient in
        # memory) until the end of backward: measured on Llama 20m stage 3, no reduce-scatter overlapped backward.
        self.pieces.sort(key=lambda pc: -pc.first_param)
        self.slot_piece = [piece_of[id(s)] for s in self.slots]
        self.slot_at = [s.bucket_offset - pc.lo for s, pc in zip(self.slots, self.slot_piece)]

    def _hook_trainable(self) -> None:
        """Hook every parameter that requires grad now and has no hook yet; a bucket (and piece) expects the
        gradients of its hooked parameters (``requires_grad`` may change after initialisation)."""
        for pc in self.pieces:
            pc.expected = 0
        for r in self.rounds:
            r.expected = r.active = 0
        for k, s in enumerate(self.slots):
            self.trainable[k] = trainable = s.param is not None and s.param.requires_grad
            if trainable and s.numel > 0:
                if k not in self._hooks:
                    self._hooks[k] = s.param.register_post_accumulate_grad_hook(self._hook(k))
                self.slot_piece[k].bucket_round.expected += 1
                self.slot_piece[k].expected += 1
        # every rank launches the same pieces in the same order (requires_grad must agree across ranks, as DDP);
        # every piece of a bucket with a hooked parameter is reduced (a frozen run's zeros included), as before
        self.active = [pc for pc in self.pieces if pc.bucket_round.expected > 0]
        for pc in self.active:
            pc.bucket_round.active += 1
        self.mode.regroup(self.active)
        for r in self.rounds:
            r.arrived = 0
            r.pending = r.active
        for pc in self.pieces:
            if pc.bucket_round.expected == 0:
                self.mode.zero_idle(pc)  # never launched while inactive: its stale values must read as zero

    def _hook(self, k: int):
        """The post-accumulate-grad hook of slot ``k``: its gradient is ready: add it into its piece (the piece
        owns it from here on), then launch, in the fixed order, every piece whose gradients are all in."""
        # Weak reference only: the hook lives on the parameter (in C++, where the garbage collector cannot see it),
        # so a strong one would keep a dropped runtime alive through its own parameters.
        me = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            red = me()
            if red is None:
                return
            grad = param.grad
            param.grad = None
            pc = red.slot_piece[k]
            if pc.launched:  # a new micro-batch began before the last round was finished
                red.finish_round()
            if red.held:  # buffers of completed reductions back to the pool before this one may take one
                red.give_back_completed()
            at = red.slot_at[k]
            # the slot's first gradient since the buffer was cleared is copied in (stages 2/3: into a transient
            # buffer, the same one each step; gaps are zeroed at launch), else accumulated (stages 0/1 over
            # micro-batches; a second backward outside runtime.backward)
            first = not pc.clean and at not in pc.written
            red.mode.write(pc, at, grad, first)
            if first:
                pc.written[at] = at + grad.numel()
            pc.arrived += 1
            r = pc.bucket_round
            r.arrived += 1
            gi, i = red.slot_flag[k]
            red.got[gi][i] = True
            red.dirty = True
            if red.reduce_now:
                if r.arrived == r.expected:
                    red.params.on_grads_done(r.bucket)
                active = red.active
                while red.next_launch < len(active):  # launch up to the first piece not complete
                    pc = active[red.next_launch]
                    if pc.arrived < pc.expected:
                        return
                    red._launch(pc)

        return hook

    def _launch(self, pc: ReductionPiece) -> None:
        """Start the piece's collective (its mode zeroes what no gradient was written first) and queue it."""
        self.params.before_reduce()
        self.next_launch += 1
        pc.launched = True
        if self.one_in_flight and self.in_flight:  # the previous reduction lands before the next starts
            self.wait_reduced()
        reduction = self.mode.launch(pc)
        if reduction is None:  # it waits for the rest of its unit batch
            return
        self.in_flight.append(reduction)
        if reduction.pooled:
            self.held.append(reduction)
        if self.one_in_flight and pc.bucket.group.partitions == 1:  # one rank: nothing to overlap, hand it over now
            self.wait_reduced()
        elif self.lands_early:  # the master store takes each reduced gradient as it lands, while backward runs
            if self.aside is not None and reduction.lands_aside:
                self._land_aside(reduction)
            else:
                self.land_completed()

    def _land_aside(self, reduction: Reduction) -> None:
        """Land ``reduction`` on the copy stream now, ordered after its collective only (the host waits for
        nothing, the compute stream goes on with backward), and tell the mode, so the master store's copies to the
        host queue behind it there; its ``handle`` then also joins the copy stream (``finish`` and the buffers'
        give-back wait for the landing)."""
        comm = self.aside
        with comm.after(reduction.handle) as event:
            reduction.land_aside()
        reduction.handle = StreamJoin(reduction.handle, event, comm)
        with comm.issuing_on(comm.copy_stream):  # the store's copies to the host queue behind the landing
            self._tell(reduction)

    def give_back_completed(self) -> None:
        """Give back the pooled buffers of the reductions whose collective has completed (polled, never waits),
        oldest first, so the next piece or batch takes one of them from the pool (held to the end of backward,
        they outnumber what the pool keeps idle, and one is freed and faulted in again every step). The rest of
        each reduction's finish (adding into the shard, telling the master store) still runs in ``finish_round``."""
        done = 0
        for reduction in self.held:
            if not reduction.handle.ready():
                break
            reduction.give_back()
            done += 1
        del self.held[:done]

    def wait_reduced(self, count: int | None = None) -> None:
        """Finish the reductions in flight (the oldest ``count`` of them; None: all), in launch order (wait, land
        the result), and tell the mode (and through it a master store that ``watches_grads``) of each bucket whose
        last piece landed, or of each piece of a bucket reduced in several (stage 3 with streamed gradients calls it
        before gathering a unit in backward, so a unit's gradient never coexists with the next unit's parameters)."""
        in_flight = self.in_flight
        landed = in_flight if count is None else in_flight[:count]
        boundary, reports = self.boundary, self.reports_buckets
        for reduction in landed:
            reduction.finish(boundary)
            if reports and not reduction.told:
                self._tell(reduction)
        if count is None:
            in_flight.clear()
            self.held.clear()
            return
        del in_flight[:count]
        held = self.held  # in launch order too: the landed ones lead it
        while held and any(held[0] is r for r in landed):
            del held[0]

    def _tell(self, reduction: Reduction) -> None:
        """Count ``reduction``'s pieces off their buckets and tell the mode of each bucket whose last piece it was,
        or of each piece of a bucket reduced in several (a master store that watches gets that part at once)."""
        boundary, mode = self.boundary, self.mode
        reduction.told = True
        for pc in reduction.pieces:
            r = pc.bucket_round
            r.pending -= 1
            if r.active > 1:
                mode.piece_reduced(pc, boundary, last=not r.pending)
            elif not r.pending:
                mode.bucket_reduced(r.bucket, boundary)

    def land_completed(self) -> None:
        """Land the reductions in flight whose collective has completed (polled, never waits), oldest first, so a
        master store that ``watches_grads`` gets each reduced gradient while backward goes on (ZeRO-Offload's copy
        to the host, SuperOffload's speculative step); the rest land in ``finish_round``."""
        done = 0
        for reduction in self.in_flight:
            if not reduction.handle.ready():
                break
            done += 1
        if done:
            self.wait_reduced(done)

    def begin_backward(self, is_boundary: bool | None) -> None:
        """Called by ``runtime.backward`` before autograd runs: decide whether this backward reduces."""
        if self.in_flight or self.next_launch or (self.every_backward and self.dirty):
            self.finish_round()  # a previous backward ran outside runtime.backward and left a round open
        self.reduce_now = self.every_backward or bool(is_boundary)
        self.boundary = is_boundary
        for s, was in zip(self.slots, self.trainable):
            if (s.param is not None and s.param.requires_grad) != was:  # requires_grad changed: hook again
                self._hook_trainable()
                break
        for pc in self.active:
            pc.arrived = 0

    def finish_round(self, final: bool = False) -> None:
        """Launch every piece not yet launched (fixed order), wait for all, add results into the shards.
        ``final``: ``step()`` follows (the master store is told ``boundary=True``)."""
        if final:
            self.boundary = True
        if not self.dirty and not self.in_flight:
            if self.clears_idle:  # nothing arrived since zero(): the persistent buffers must read as zero
                for pc in self.pieces:
                    self.mode.zero_idle(pc)
            return
        for pc in self.active[self.next_launch :]:
            r = pc.bucket_round
            if r.arrived < r.expected:
                r.arrived = r.expected  # told once
                self.params.on_grads_done(r.bucket)
            self._launch(pc)
        with record_function("zero::reduce"):
            self.wait_reduced()
        self._new_round()
        self.dirty = False
        self.mode.round_finished()

    def _new_round(self) -> None:
        for pc in self.active:
            pc.launched = False
            pc.arrived = 0
        for r in self.rounds:
            r.arrived = 0
            r.pending = r.active
        self.next_launch = 0

    def end_backward(self) -> None:
        """After autograd: stages 2/3 (and a boundary backward at 0/1) finish their round now."""
        if self.reduce_now:
            self.finish_round()
        self.reduce_now = self.every_backward

    def _wait_all(self) -> None:
        """Wait for every collective in flight without landing it (ranks stay matched), then forget them."""
        for reduction in self.in_flight:
            reduction.handle.wait()
        self.in_flight.clear()
        self.held.clear()

    def zero(self) -> None:
        """Drop accumulated gradients (after waiting for any collective in flight, so ranks stay matched)."""
        if self.in_flight:
            self._wait_all()
        self.mode.zero(self.pieces)
        if self.dirty or self.next_launch:  # a round is open (else finish_round reset it)
            self._new_round()
        self.dirty = False
        for flags in self.got.values():
            flags[:] = [False] * len(flags)

    def has_grad(self) -> dict[int, list[bool]]:
        """Flat-group index -> per slot (``g.slots`` order): a gradient arrived on this rank since ``zero()``."""
        return self.got

    def close(self) -> None:
        """Detach every gradient hook (after waiting for collectives in flight)."""
        self._wait_all()
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self.mode.close(self.pieces)
