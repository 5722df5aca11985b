"""Gradient reduction: per-parameter hooks fill reduction pieces; a complete piece launches its collective.

Stage 0 all-reduces (average) each piece; stages 1-3 reduce-scatter it, each rank adding its chunk into its
gradient shard (``grad_shard(g)``, the optimizer's ``.grad``). Pieces launch strictly in one fixed order (the order
backward normally produces them), so every rank issues the same collectives in the same order even when ranks use
different parameters: a piece whose gradients are not all ready when backward ends is launched anyway, its missing
gradients counting as zero (DeepSpeed's treatment of unused parameters).

A layout bucket is reduced in *pieces* (reduction buckets, DDP's buckets; ``reduce_piece.ReductionPiece``):
contiguous runs of whole parameters of at most ``reduce_bucket_size`` elements and DDP's 25 MiB
(:data:`DDP_BUCKET_BYTES`), each launched as soon as its last gradient is in, so reductions overlap the rest of
backward while the layout keeps one bucket per flat group (a rank's shard stays one contiguous range, which the fp32
master aliases: the ZeRO memory formula). A piece smaller than its bucket is reduced with
``zero_comm.reduce_scatter_uneven``: summed over a bucket, the bytes of one reduce-scatter. Stage 3 reduces each
unit whole, several adjacent units together on several ranks (``reduce_batched``).

Stages 2 and 3 reduce every backward (micro-batch) and keep only the shard. Stages 0 and 1 keep the full local
gradient and reduce only when a backward is marked as the accumulation boundary, or at ``step()`` otherwise; nothing
a backward produced is ever dropped (reductions are linear: reducing several times before one step gives the sum).

:class:`GradReducer` is the driver every mode shares (hooks, pieces, launch order, rounds); what differs by mode
(where a gradient is written, which collective a launch starts, where its result goes) is a
``reduce_mode.ReductionMode`` chosen by :func:`reduction_mode`, as Megatron-core's bucket group drives its buckets.
"""

from __future__ import annotations

import weakref

import torch
from torch.profiler import record_function

from zero_core.grad_reduction import GradComm, default_grad_comm
from zero_core.layout import FlatGroup, split_by_size
from zero_core.reduce_batched import UnitBatchMode
from zero_core.reduce_mode import AllReduceMode, ReductionMode, TransientScatterMode
from zero_core.reduce_persistent import PersistentScatterMode
from zero_core.reduce_piece import BucketRound, ReductionPiece
from zero_core.reduce_streamed import StreamedMode

# DDP's default bucket_cap_mb: a reduction piece holds at most this many bytes of the reduce dtype.
DDP_BUCKET_BYTES = 25 * 2**20


def reduction_mode(reducer: GradReducer, rt, comm: GradComm) -> ReductionMode:
    """The mode for ``rt``'s stage and master store (see ``zero_core.reduce_mode``).

    Raises:
        ValueError: ``comm`` does not fit the stage (stage 0 averages whole buffers in place; stages 1-3 need a
            collective that scatters).
    """
    if comm.scatters != (rt.stage > 0):
        want = "a scattering collective (reduce-scatter)" if rt.stage else "an all-reduce (scatters False)"
        raise ValueError(f"GradReducer: stage {rt.stage} needs {want} as comm, got {type(comm).__name__}")
    if rt.stage == 0:
        return AllReduceMode(reducer, rt, comm)
    if rt.stage == 1:
        return PersistentScatterMode(reducer, rt, comm)
    if rt.stage == 3 and rt.master.takes_grad_shards:
        return StreamedMode(reducer, rt, comm)
    if rt.stage == 3 and rt.world > 1 and comm.joins_units and not rt.config.offloads:
        return UnitBatchMode(reducer, rt, comm)  # (with offload, memory first: one unit per reduce-scatter)
    return TransientScatterMode(reducer, rt, comm)


class GradReducer:
    """Owns the gradient hooks, reduction pieces and rounds of one runtime (see the module docstring); implements
    ``zero_core.grad_reduction.GradReduction``.

    Args:
        comm: the bucket collective (``zero_core.grad_reduction.GradComm``); None: chosen from the config by
            ``default_grad_comm``.
        piece_bytes: on more than one rank, most bytes (of the reduce dtype) per reduction piece (stages 0-2) or
            per batch of units (stage 3), on top of ``reduce_bucket_size`` (elements); default DDP's 25 MiB.

    Raises:
        ValueError: ``piece_bytes`` is not positive; at ``attach``, ``comm`` does not fit the stage.
    """

    def __init__(self, comm: GradComm | None = None, piece_bytes: int = DDP_BUCKET_BYTES):
        if piece_bytes <= 0:
            raise ValueError(f"GradReducer: piece_bytes must be a positive byte count, got {piece_bytes}")
        self.comm = comm
        self.piece_bytes = piece_bytes
        # what attach reads off the runtime (the layout is frozen from then on)
        self.rt = None
        self.stage = 0
        self.mode: ReductionMode | None = None
        self.groups: list[FlatGroup] = []  # the trainable flat groups
        self.pieces: list[ReductionPiece] = []  # in launch order
        self.piece_of: dict[int, ReductionPiece] = {}  # id(slot) -> its piece
        self.active: list[ReductionPiece] = []  # the pieces with hooked gradients, in launch order
        self._slot_index: dict[int, int] = {}  # id(slot) -> its index in its flat group
        self._hooks: dict[int, object] = {}  # id(slot) -> hook handle (kept so close() removes them)
        self.streamed = False  # see GradReduction.streamed
        # per round (reset by zero() / a round's end)
        self.next_launch = 0  # the next piece of ``active`` to launch
        self.reduce_now = False  # reductions launch during backward (stages 2/3, or a stage-1 boundary)
        self.boundary: bool | None = None
        self.dirty = False  # some gradient arrived since the last completed round
        self.in_flight: list = []  # (piece or batch, its finish) of the reductions started, in launch order
        self.held: list = []  # (piece or batch, give back) of those holding a pooled buffer, in launch order
        self.got: dict[int, list[bool]] = {}  # FlatGroup.index -> per slot: a gradient arrived since zero()
        self.rounds: list[BucketRound] = []  # each layout bucket with parameters: its counts, shared by its pieces

    def attach(self, rt) -> None:
        """Choose the mode, allocate gradient shards (and stages 0/1's full buffers), cut every bucket into
        pieces, hook the parameters."""
        self.rt, self.stage = rt, rt.stage
        self.comm = self.comm or default_grad_comm(rt)
        self.mode = reduction_mode(self, rt, self.comm)
        self.streamed = self.mode.streamed
        self.groups = [g for g in rt.flat_groups if g.group_index is not None]
        self.reduce_now = self.stage >= 2
        self.got = {g.index: [False] * len(g.slots) for g in self.groups}
        self._slot_index = {id(s): i for g in self.groups for i, s in enumerate(g.slots)}
        self.mode.allocate(self.groups)
        self._cut_pieces()
        self._hook_trainable()

    def grad_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of ``g`` (None for a frozen group, or after ``close()``)."""
        shards = self.mode.shards
        return shards[g.index] if g.index < len(shards) else None

    def resident(self) -> list[torch.Tensor]:
        """The gradient shards and gradient buffers held now (stages 2/3: pieces not yet reduced)."""
        return self.mode.resident(self.pieces)

    def _cut_pieces(self) -> None:
        """Pieces of every bucket with parameters, in launch order (backward meets the last parameters first)."""
        limit = self.mode.piece_limit()
        self.pieces, self.piece_of, self.rounds = [], {}, []
        for g in self.groups:
            for b in g.buckets:
                if not b.slots:
                    continue
                bucket_round = BucketRound(b)
                self.rounds.append(bucket_round)
                runs = split_by_size(list(b.slots), limit, lambda s: s.numel) if limit else [list(b.slots)]
                for i, run in enumerate(runs):
                    lo = 0 if i == 0 else run[0].bucket_offset
                    hi = b.padded_numel if i == len(runs) - 1 else runs[i + 1][0].bucket_offset
                    piece = ReductionPiece(b, bucket_round, lo, hi, min(s.param_index for s in run), len(run))
                    self.mode.new_piece(piece, run)
                    self.piece_of.update((id(s), piece) for s in run)
                    self.pieces.append(piece)
        # Backward meets a piece's first parameter last, so that order launches each piece as soon as it is
        # complete. By last parameter, a piece spread over the model (stage 3's persistent norms, a no-decay group's
        # biases) would be first in line and hold every later launch (and, streamed, every unit's gradient in
        # memory) until the end of backward: measured on Llama 20m stage 3, no reduce-scatter overlapped backward.
        self.pieces.sort(key=lambda pc: -pc.first_param)

    def _hook_trainable(self) -> None:
        """Hook every parameter that requires grad now and has no hook yet; a bucket (and piece) expects the
        gradients of its hooked parameters (``requires_grad`` may change after initialisation)."""
        for pc in self.pieces:
            pc.expected = 0
        for r in self.rounds:
            r.expected = 0
            for s in r.bucket.slots:
                if s.trainable and s.numel > 0:
                    if id(s) not in self._hooks:
                        self._hooks[id(s)] = s.param.register_post_accumulate_grad_hook(self._hook(s))
                    r.expected += 1
                    self.piece_of[id(s)].expected += 1
        # every rank launches the same pieces in the same order (requires_grad must agree across ranks, as DDP);
        # every piece of a bucket with a hooked parameter is reduced (a frozen run's zeros included), as before
        self.active = [pc for pc in self.pieces if pc.bucket_round.expected > 0]
        self.mode.regroup(self.active)
        for r in self.rounds:
            r.arrived = 0
        for pc in self.pieces:
            if pc.bucket_round.expected == 0:
                self.mode.zero_idle(pc)  # never launched while inactive: its stale values must read as zero

    def _hook(self, slot):
        index = self._slot_index[id(slot)]
        # Weak references only: the hook lives on the parameter (in C++, where the garbage collector cannot see
        # it), so a strong one would keep a dropped runtime alive through its own parameters.
        me, slot_ref = weakref.ref(self), weakref.ref(slot)

        def hook(param: torch.Tensor) -> None:
            reducer, s = me(), slot_ref()
            if reducer is not None and s is not None:
                reducer._accumulate(param, s, index)

        return hook

    def _accumulate(self, param: torch.Tensor, slot, index: int) -> None:
        """``param``'s gradient is ready: add it into its piece, launch the pieces that are complete."""
        grad = param.grad
        param.grad = None  # the piece owns the gradient from here on
        piece = self.piece_of[id(slot)]
        if piece.launched:  # a new micro-batch began before the last round was finished
            self.finish_round()
        at = slot.bucket_offset - piece.lo
        first = not piece.clean and at not in piece.written  # the slot's first gradient since the buffer was
        # cleared: copy it in (stages 2/3: into a transient buffer, the same one each step); gaps are zeroed at
        # launch. Else accumulate (stages 0/1 over micro-batches; a second backward outside runtime.backward).
        self.mode.write(piece, at, grad, first)
        if first:
            piece.record_write(at, slot.numel)
        piece.arrived += 1
        r = piece.bucket_round
        r.arrived += 1
        self.got[r.bucket.group.index][index] = True
        self.dirty = True
        if self.reduce_now:
            if r.arrived == r.expected:
                self.rt.params.on_grads_done(r.bucket)
            self._launch_complete()

    def _launch_complete(self) -> None:
        """Launch, in the fixed order, every piece whose gradients are all in, up to the first that is not."""
        while self.next_launch < len(self.active):
            pc = self.active[self.next_launch]
            if pc.arrived < pc.expected:
                return
            self._launch(pc)

    def _launch(self, pc: ReductionPiece) -> None:
        self.rt.params.before_reduce()
        self.next_launch += 1
        pc.launched = True
        self.mode.zero_unwritten(pc)
        self.mode.launch(pc)

    def give_back_completed(self) -> None:
        """Give back the pooled buffers of the reductions whose collective has completed (polled, never waits),
        oldest first, so the next piece or batch takes one of them from the pool (held to the end of backward,
        they outnumber what the pool keeps idle, and one is freed and faulted in again every step). The rest of
        each reduction's finish (adding into the shard, telling the master store) still runs in ``finish_round``."""
        done = 0
        for owner, give_back in self.held:
            if not owner.handle.ready():
                break
            owner.handle.wait()  # completes at once; runs the all-to-all's sum, which reads the receive buffer
            give_back(owner)
            done += 1
        del self.held[:done]

    def wait_reduced(self) -> None:
        """Wait for the reductions in flight and finish them (stage 3 with streamed gradients calls it before
        gathering a unit in backward, so a unit's gradient never coexists with the next unit's parameters)."""
        for owner, finish in self.in_flight:
            owner.handle.wait()
            finish(owner)
        self.in_flight.clear()
        self.held.clear()

    def piece_reduced(self, pc: ReductionPiece) -> None:
        """A piece's result is in the shard; once its bucket's last piece is, the mode tells the master store."""
        r = pc.bucket_round
        r.pending -= 1
        if not r.pending:
            self.mode.bucket_reduced(r.bucket)

    def begin_backward(self, is_boundary: bool | None) -> None:
        """Called by ``runtime.backward`` before autograd runs: decide whether this backward reduces."""
        if self.in_flight or self.next_launch or (self.stage >= 2 and self.dirty):
            self.finish_round()  # a previous backward ran outside runtime.backward and left a round open
        self.reduce_now = self.stage >= 2 or bool(is_boundary)
        self.boundary = is_boundary
        self._hook_trainable()
        for pc in self.active:
            pc.arrived = 0

    def finish_round(self, final: bool = False) -> None:
        """Launch every piece not yet launched (fixed order), wait for all, add results into the shards.
        ``final``: ``step()`` follows (the master store is told ``boundary=True``)."""
        if final:
            self.boundary = True
        if not self.dirty and not self.in_flight:
            for pc in self.pieces:  # nothing arrived since zero(): the persistent buffers must read as zero
                self.mode.zero_idle(pc)
            return
        for r in self.rounds:
            r.pending = 0
        for pc in self.active:
            pc.bucket_round.pending += 1
        for pc in self.active[self.next_launch :]:
            r = pc.bucket_round
            if r.arrived < r.expected:
                r.arrived = r.expected  # told once
                self.rt.params.on_grads_done(r.bucket)
            self._launch(pc)
        with record_function("zero::reduce"):
            self.wait_reduced()
        self._new_round()
        self.dirty = False
        self.mode.round_finished()

    def _new_round(self) -> None:
        for pc in self.active:
            pc.new_round()
        for r in self.rounds:
            r.arrived = 0
        self.next_launch = 0

    def end_backward(self) -> None:
        """After autograd: stages 2/3 (and a boundary backward at 0/1) finish their round now."""
        if self.reduce_now:
            self.finish_round()
        self.reduce_now = self.stage >= 2

    def _wait_all(self) -> None:
        """Wait for every collective in flight without finishing it (ranks stay matched), then forget them."""
        for owner, _ in self.in_flight:
            owner.handle.wait()
        self.in_flight.clear()
        self.held.clear()

    def zero(self) -> None:
        """Drop accumulated gradients (after waiting for any collective in flight, so ranks stay matched)."""
        self._wait_all()
        self.mode.zero(self.groups, self.pieces)
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
