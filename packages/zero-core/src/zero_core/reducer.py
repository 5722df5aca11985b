"""Gradient reduction: per-parameter hooks fill bucket buffers; a full bucket launches its collective.

Stage 0 all-reduces (average) each bucket; stages 1-3 reduce-scatter it, each rank adding its chunk into its
gradient shard (``grad_shard(g)``, the optimizer's ``.grad``). Buckets launch strictly in one fixed order (the
order backward normally produces them), so every rank issues the same collectives in the same order even when
ranks use different parameters: a bucket whose gradients are not all ready when backward ends is launched
anyway, its missing gradients counting as zero (DeepSpeed's treatment of unused parameters).

A layout bucket is reduced in *pieces* (reduction buckets, DDP's buckets): contiguous runs of whole parameters of at
most ``reduce_bucket_size`` elements and at most DDP's 25 MiB (:data:`DDP_BUCKET_BYTES`), each launched as soon as
its last gradient is in, so reductions overlap the rest of backward while the layout keeps one bucket per flat group
(a rank's shard stays one contiguous range, which the fp32 master aliases: the ZeRO memory formula). A piece that
is a whole bucket is reduced with the bucket's collective (all-reduce, reduce-scatter, qgZ); a smaller piece at
stages 1-2 covers the ends of some ranks' chunks (or lies inside one), and ``zero_comm.reduce_scatter_uneven`` hands
each rank its part: summed over a bucket, the bytes of one reduce-scatter. Stage 3 reduces each unit whole, and
several units adjacent in the flat group and in launch order together (a :class:`_Batch`, DeepSpeed's IPG bucket of
``reduce_bucket_size``, here also capped at DDP's 25 MiB): one reduce-scatter of a rank-major buffer whose part ``r``
is the units' chunks ``r`` side by side, so rank ``r`` receives one contiguous range of its shard. Gradients are
written straight into their place in that buffer (no copy at launch); 78 per-module reduce-scatters of Llama 20m
become 4. Not with offload (``ZeroConfig.offloads``: memory comes first; a batch holds up to 25 MiB more in flight).

Stages 2 and 3 reduce every backward (micro-batch) and keep only the shard. Stages 0 and 1 keep the full local
gradient and reduce only when a backward is marked as the accumulation boundary, or at ``step()`` otherwise; in
both cases nothing a backward produced is ever dropped. Reductions are linear, so reducing several times
before one step gives the same sum.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from zero_comm.buffers import scratch
from zero_core.grad_reduction import GradComm, default_grad_comm
from zero_core.layout import Bucket, FlatGroup, split_by_size

# DDP's default bucket_cap_mb: a reduction piece holds at most this many bytes of the reduce dtype.
DDP_BUCKET_BYTES = 25 * 2**20


@dataclass(eq=False)
class _Piece:
    """One reduction: bucket-local elements ``[lo, hi)`` of ``bucket`` (whole parameters; the first piece starts
    at 0, the last ends at ``padded_numel``), its gradient buffer and readiness."""

    bucket: Bucket
    lo: int
    hi: int
    first_param: int  # smallest model position among its parameters: launch order (see GradReducer._cut_pieces)
    expected: int = 0
    ready: int = 0
    launched: bool = False
    grad: torch.Tensor | None = None  # stages 0/1: a view of the bucket's persistent buffer; 2/3: transient
    transient: bool = False  # stages 2/3: ``grad`` is allocated per round and dropped once reduced
    # piece-local start -> end of each slot written since the buffer was last (logically) cleared; the rest of the
    # buffer holds stale values, zeroed only at launch (stages 0/1: no memset of the whole buffer per step)
    filled: dict = field(default_factory=dict)
    clean: bool = True  # stages 0/1: every element of ``grad`` is meaningful (zero or accumulated): add into it
    slots: int = 0  # parameters in [lo, hi)
    # streamed, a piece of one parameter starting at ``lo``: its collective moves that parameter's elements only
    # (the same extent on every rank, whether the gradient is borrowed or, absent here, a zero buffer); 0: hi - lo
    sent: int = 0
    borrowed: bool = False  # streamed: ``grad`` is autograd's own gradient of the piece's one parameter (not pooled)

    batch: _Batch | None = None  # stage 3: the units reduced together with this one (its gradient lives there)

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.bucket.padded_numel


@dataclass(eq=False)
class _Batch:
    """Stage 3: whole-unit pieces of one flat group, adjacent in flat order, reduced by one reduce-scatter.

    ``buf`` (``partitions * stride`` elements of the reduce dtype, taken when the first gradient arrives) is
    rank-major: part ``r`` holds every member's chunk ``r``, member ``m``'s at ``offset[m]`` inside the part, in
    shard order, so rank ``r``'s result is its shard ``[first.shard_offset, first.shard_offset + stride)``.
    """

    members: list[_Piece]  # flat order (the reverse of launch order)
    stride: int = 0  # elements per rank: the members' chunks summed
    offset: dict = field(default_factory=dict)  # member piece -> its chunk's start inside a rank's part
    buf: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for pc in self.members:
            self.offset[pc] = self.stride
            self.stride += pc.bucket.chunk
            pc.batch = self

    def spans(self, pc: _Piece, lo: int, hi: int):
        """(buffer view, source offset) for member ``pc``'s bucket-local elements ``[lo, hi)``, split at chunk
        boundaries (a parameter may straddle ranks' chunks)."""
        chunk = pc.bucket.chunk
        for r in range(lo // chunk, -(-hi // chunk)):
            a, e = max(lo, r * chunk), min(hi, (r + 1) * chunk)
            at = r * self.stride + self.offset[pc] + a - r * chunk
            yield self.buf[at : at + e - a], a - lo


class _Part:
    """This rank's part of a piece's scattering reduction: bucket-local ``[a, e)`` inside its chunk (which starts at
    bucket-local ``base``), at shard offset ``at``; ``send`` is what the collective sends (up to ``hi``: a piece of
    one parameter does not send its padding)."""

    __slots__ = ("send", "hi", "base", "a", "e", "at")

    def __init__(self, pc: _Piece, send: torch.Tensor) -> None:
        b = pc.bucket
        self.base = b.group.rank * b.chunk
        self.hi = pc.lo + pc.sent if pc.sent else pc.hi
        self.send = send[: self.hi - pc.lo] if send.numel() > self.hi - pc.lo else send
        self.a = max(pc.lo, self.base)
        self.e = max(self.a, min(self.hi, self.base + b.chunk))
        self.at = b.shard_offset + self.a - self.base


class GradReducer:
    """Owns the gradient hooks and reduction rounds of one runtime (see the module docstring); implements
    ``zero_core.grad_reduction.GradReduction``.

    Runtime state it owns (the layout is frozen): per flat group (``FlatGroup.index``) the gradient shard; per
    bucket (lists indexed by ``Bucket.index``) its persistent gradient buffer (stages 0/1); per reduction piece its
    buffer, readiness and launch flag; per bucket how many gradients it expects and has this round.

    Args:
        comm: the bucket collective (``zero_core.grad_reduction.GradComm``); None: chosen from the config by
            ``default_grad_comm``.
        piece_bytes: on more than one rank, most bytes (of the reduce dtype) per reduction piece (stages 0-2) or
            per batch of units (stage 3), on top of ``reduce_bucket_size`` (elements); default DDP's 25 MiB.
    """

    def __init__(self, comm: GradComm | None = None, piece_bytes: int = DDP_BUCKET_BYTES):
        if piece_bytes <= 0:
            raise ValueError(f"GradReducer: piece_bytes must be a positive byte count, got {piece_bytes}")
        self.comm = comm
        self.piece_bytes = piece_bytes
        # what attach reads off the runtime (the layout is frozen from then on)
        self.rt = None
        self.stage = 0
        self.reduce_dtype = self.accum_dtype = torch.float32
        self.groups: list[FlatGroup] = []  # the trainable flat groups
        self.shards: list[torch.Tensor | None] = []  # FlatGroup.index -> gradient shard
        self.grads: list[torch.Tensor | None] = []  # Bucket.index -> persistent buffer (stages 0/1)
        self.pieces: list[_Piece] = []  # reduction pieces in launch order
        self.piece_of: dict[int, _Piece] = {}  # id(slot) -> its piece
        self.active: list[_Piece] = []  # the pieces with hooked gradients, in launch order
        self._slot_index: dict[int, int] = {}  # id(slot) -> its index in its flat group
        self._hooks: dict[int, object] = {}  # id(slot) -> hook handle (kept so close() removes them)
        self.streamed = False  # see GradReduction.streamed
        # per round (reset by zero() / a round's end)
        self.next_launch = 0  # the next piece of ``active`` to launch
        self.reduce_now = False  # reductions launch during backward (stages 2/3, or a stage-1 boundary)
        self.boundary: bool | None = None
        self.dirty = False  # some gradient arrived since the last completed round
        self.handles: list = []  # (handle, then) of reductions in flight
        self.fresh = True  # every gradient shard is zero (nothing reduced since zero())
        self.own_chunk: set[Bucket] = set()  # stage 1: buckets whose shard is a view of their full gradient
        self.reduced: set[Bucket] = set()  # ... whose own chunk holds a reduced (not local) value
        self.stashed: dict[Bucket, torch.Tensor] = {}  # reduced values moved aside for a further round
        self.got: dict[int, list[bool]] = {}  # FlatGroup.index -> per slot: a gradient arrived since zero()
        self.expected: dict[Bucket, int] = {}  # hooked gradients per bucket
        self.arrived: dict[Bucket, int] = {}  # ... arrived this round
        self.pending: dict[Bucket, int] = {}  # pieces of the round not finished yet, per bucket
        self.batches: list[_Batch] = []
        self._batched_for: tuple = ()  # the active pieces the batches were formed for
        self._in_flight: list = []  # (handle, give back) of stage 2/3 reductions whose buffers are held, in order
        self.stream_reductions = 0  # streamed reductions launched (each waited for before the next one starts)
        self.stream_borrowed = 0  # ... of them sent straight from autograd's gradient (``_borrow``)

    def attach(self, rt) -> None:
        """Allocate gradient buffers for every trainable flat group, cut its buckets into pieces, hook its
        parameters."""
        self.rt = rt
        p = rt.precision
        stage = self.stage = rt.stage
        self.comm = self.comm or default_grad_comm(rt)
        self.reduce_dtype, self.accum_dtype = p.reduce, p.accum
        self.groups = [g for g in rt.flat_groups if g.group_index is not None]
        self.reduce_now = stage >= 2
        self.got = {g.index: [False] * len(g.slots) for g in self.groups}
        self._slot_index = {id(s): i for g in self.groups for i, s in enumerate(g.slots)}
        n = sum(len(g.buckets) for g in rt.flat_groups)
        self.shards, self.grads = [None] * len(rt.flat_groups), [None] * n
        # stage 3 with a master store that keeps the gradients itself (ZeRO-Infinity: streamed to NVMe): no shard
        # here; each bucket's reduced chunk goes straight to ``on_grad_ready``, every micro-batch
        self.streamed = stage == 3 and rt.master.takes_grad_shards
        for g in self.groups:
            if not self.streamed:
                self.shards[g.index] = torch.zeros(g.shard_numel, dtype=self.accum_dtype, device=g.device)
            if stage <= 1:  # full local gradients, persistent
                full = torch.zeros(g.padded_numel, dtype=self.accum_dtype, device=g.device)
                pos = 0
                for b in g.buckets:
                    self.grads[b.index] = full[pos : pos + b.padded_numel]
                    pos += b.padded_numel
                if stage == 0:
                    self.shards[g.index] = full  # one partition: the reduced full buffer is the accumulator
                elif len(g.buckets) == 1:  # ZeRO formula: the shard is this rank's chunk of the full buffer
                    b = g.buckets[0]
                    self.shards[g.index] = self.grads[b.index][slice(*b.chunk_range(g.rank))]
                    self.own_chunk.add(b)
        self._cut_pieces()
        self._hook_trainable()

    def grad_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of ``g`` (None for a frozen group, or after ``close()``)."""
        return self.shards[g.index] if g.index < len(self.shards) else None

    def resident(self) -> list[torch.Tensor]:
        """The gradient shards and gradient buffers held now (stages 2/3: pieces not yet reduced)."""
        pieces = [pc.grad for pc in self.pieces if pc.transient] + [bt.buf for bt in self.batches]
        return [t for t in self.shards + self.grads + pieces if t is not None]

    def _cut_pieces(self) -> None:
        """Pieces of every bucket with parameters, in launch order (backward meets the last parameters first)."""
        limit = self.rt.config.reduce_bucket_size
        if self.stage < 3 and self.rt.world > 1:
            limit = min(limit, max(1, self.piece_bytes // torch.empty(0, dtype=self.reduce_dtype).element_size()))
        elif not (self.streamed and self.comm.takes_pieces):
            limit = None  # stage 3 reduces each unit whole (it is released as a whole)
        # (streamed: runs of at most reduce_bucket_size, so a unit's gradient need not be held whole; see _borrow)
        self.pieces = []
        self.piece_of = {}
        for g in self.groups:
            for b in g.buckets:
                if not b.slots:
                    continue
                runs = [[(s, None) for s in b.slots]]  # stage 3 (or one rank): the whole bucket
                if limit:
                    runs = split_by_size([(s, s.param) for s in b.slots], limit, lambda item: item[0].numel)
                for i, run in enumerate(runs):
                    lo = 0 if i == 0 else run[0][0].bucket_offset
                    hi = b.padded_numel if i == len(runs) - 1 else runs[i + 1][0][0].bucket_offset
                    piece = _Piece(b, lo, hi, min(s.param_index for s, _ in run), slots=len(run))
                    if self.streamed and limit and len(run) == 1 and run[0][0].bucket_offset == lo:
                        piece.sent = run[0][0].numel
                    for s, _ in run:
                        self.piece_of[id(s)] = piece
                    self.pieces.append(piece)
                    if self.stage <= 1:
                        piece.grad = self.grads[b.index][lo:hi]
                    else:
                        piece.transient, piece.clean = True, False
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
        for g in self.groups:
            for b in g.buckets:
                self.expected[b] = 0
                for s in b.slots:
                    if s.trainable and s.numel > 0:
                        if id(s) not in self._hooks:
                            self._hooks[id(s)] = s.param.register_post_accumulate_grad_hook(self._hook(s))
                        self.expected[b] += 1
                        self.piece_of[id(s)].expected += 1
        # every rank launches the same pieces in the same order (requires_grad must agree across ranks, as DDP);
        # every piece of a bucket with a hooked parameter is reduced (a frozen run's zeros included), as before
        self.active = [pc for pc in self.pieces if self.expected[pc.bucket] > 0]
        self._form_batches()
        self.arrived = {b: 0 for b in self.expected}
        for pc in self.pieces:
            if self.expected[pc.bucket] == 0:
                self._settle(pc)  # never launched while inactive: its stale values must read as zero

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
        param.grad = None  # the bucket owns the gradient from here on
        piece = self.piece_of[id(slot)]
        if piece.launched:  # a new micro-batch began before the last round was finished
            self.finish_round()
        bucket = piece.bucket
        self._stash(bucket)
        at = slot.bucket_offset - piece.lo
        first = not piece.clean and at not in piece.filled  # the slot's first gradient since the buffer was cleared:
        # copy it in (stages 2/3: into a transient buffer, the same one each step); gaps are zeroed at launch.
        # Else accumulate (stages 0/1 over micro-batches; a second backward outside runtime.backward).
        if not (first and self._borrow(piece, at, grad)):
            for view, src in self._spans(piece, at, at + slot.numel, grad.device):
                part = grad.reshape(-1)[src : src + view.numel()]
                view.copy_(part) if first else view.add_(part)
        if first:
            piece.filled[at] = at + slot.numel
        piece.ready += 1
        self.arrived[bucket] += 1
        self.got[bucket.group.index][index] = True
        self.dirty = True
        if self.reduce_now:
            if self.arrived[bucket] == self.expected[bucket]:
                self.rt.params.on_grads_done(bucket)
            self._launch_ready()

    def _borrow(self, pc: _Piece, at: int, grad: torch.Tensor) -> bool:
        """Streamed, a piece of one parameter: keep autograd's gradient itself as the piece's send buffer (the
        reducer now holds its only reference), instead of copying it into a buffer of the piece's size. The
        collective then moves the parameter's elements only (a trailing padding receives no gradient: the store
        steps it with zero, as an unwritten range). With ``reduce_bucket_size`` below two parameters, no unit-sized
        gradient buffer exists at all: what backward holds is autograd's gradient of one parameter besides the one
        reduction in flight (ZeRO-Infinity's memory-first path)."""
        if not (pc.sent and at == 0 and pc.grad is None and grad.is_contiguous()
                and grad.dtype == self.reduce_dtype):  # fmt: skip
            return False
        pc.grad, pc.borrowed = grad.detach().reshape(-1), True
        self.stream_borrowed += 1
        return True

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.active):
            pc = self.active[self.next_launch]
            if pc.ready < pc.expected:
                return
            self._launch(pc)

    def _form_batches(self) -> None:
        """Stage 3 (not streamed, several ranks, a plain reduce-scatter): group runs of active whole-unit pieces,
        adjacent in launch order and in their flat group, up to ``reduce_bucket_size`` and DDP's 25 MiB."""
        key = tuple(map(id, self.active))
        if key == self._batched_for:
            return
        for bt in self.batches:
            self._give_batch(bt)
            for pc in bt.members:
                pc.batch = None
        self.batches, self._batched_for = [], key
        if self.stage < 3 or self.streamed or self.rt.world == 1 or not self.comm.joins_units \
                or self.rt.config.offloads:  # fmt: skip  # memory first: one unit per reduce-scatter
            return
        elem = torch.empty(0, dtype=self.reduce_dtype).element_size()
        limit = min(self.rt.config.reduce_bucket_size, max(1, self.piece_bytes // elem))
        run: list[_Piece] = []
        size = 0  # elements of ``run``
        for pc in self.active + [None]:
            prev = run[-1].bucket if run else None
            if pc is not None and prev is not None and pc.bucket.group is prev.group \
                    and pc.bucket.index == prev.index - 1 and size + pc.bucket.padded_numel <= limit:  # fmt: skip
                run.append(pc)
                size += pc.bucket.padded_numel
                continue
            if len(run) > 1:
                self.batches.append(_Batch(run[::-1]))
            run, size = ([pc], pc.bucket.padded_numel) if pc is not None else ([], 0)

    def _spans(self, pc: _Piece, lo: int, hi: int, device):
        """(buffer view, source offset) covering piece-local elements ``[lo, hi)`` of ``pc``'s gradient."""
        if pc.batch is None:
            if pc.grad is None:
                self._reap()
                pc.grad = scratch.take(pc.hi - pc.lo, self.reduce_dtype, device)
            return [(pc.grad[lo:hi], 0)]
        bt = pc.batch
        if bt.buf is None:
            self._reap()
            bt.buf = scratch.take(pc.bucket.group.partitions * bt.stride, self.reduce_dtype, device)
        return bt.spans(pc, lo, hi)

    def _reap(self) -> None:
        """Give back the gradient buffers of the reductions whose collective has completed (polled, never waits),
        oldest first, so the next piece or batch takes one of them from the pool. Without it every buffer stayed
        held to the end of backward: on Llama 20m (stage 3, 2 ranks) five batch buffers of 25 MB, one more than the
        pool keeps idle, so 25 MB was freed and faulted in again every step (about 6k page faults). The rest of
        each reduction's finish (adding into the shard, telling the master store) still runs in ``finish_round``."""
        done = 0
        for handle, give_back in self._in_flight:
            if not handle.ready():
                break
            handle.wait()  # completes at once; runs the all-to-all's sum, which reads the receive buffer
            give_back()
            done += 1
        del self._in_flight[:done]

    def _give_batch(self, bt: _Batch) -> None:
        if bt.buf is not None:
            scratch.give(bt.buf)
            bt.buf = None

    def _launch_batch(self, bt: _Batch) -> None:
        """Every member is launched (their gaps zeroed): one reduce-scatter of the rank-major buffer into this
        rank's contiguous shard range of the members."""
        first, g = bt.members[0].bucket, bt.members[0].bucket.group
        shard = self.shards[g.index][first.shard_offset : first.shard_offset + bt.stride]
        direct = self.fresh and shard.dtype == self.reduce_dtype
        out = shard if direct else scratch.take(bt.stride, self.reduce_dtype, bt.buf.device)
        with self.rt.comm_ctx.on(self.rt.comm_ctx.reduce_stream):  # CUDA: off the compute stream
            handle = self.comm(out, bt.buf)
        self._in_flight.append((handle, lambda bt=bt: self._give_batch(bt)))

        def finish(bt=bt, out=out, shard=shard):
            if out is not shard:
                shard.add_(out)
                scratch.give(out)
            self._give_batch(bt)
            for pc in bt.members:
                self._done(pc)

        self.handles.append((handle, finish))

    def _launch(self, pc: _Piece) -> None:
        self.rt.params.before_reduce()
        self.next_launch += 1
        pc.launched = True
        self._zero_gaps(pc)
        if pc.batch is not None:  # launch order is the reverse of flat order: the first member launches last
            if pc is pc.batch.members[0]:
                self._launch_batch(pc.batch)
            return
        send = pc.grad if pc.grad.dtype == self.reduce_dtype else pc.grad.to(self.reduce_dtype)
        if not self.comm.scatters:
            self._launch_all_reduce(pc, send)
            return
        part = _Part(pc, send)
        if pc.bucket in self.own_chunk:
            self._launch_own_chunk(pc, part)
        elif self.streamed:
            self._launch_streamed(pc, part)
        else:
            self._launch_into_shard(pc, part)

    def _reduce(self, pc: _Piece, part: _Part, out: torch.Tensor):
        """Start the scattering collective of ``part`` into ``out`` (``part.e - part.a`` elements)."""
        b = pc.bucket
        with self.rt.comm_ctx.on(self.rt.comm_ctx.reduce_stream):  # CUDA: off the compute stream
            if pc.whole and part.hi == pc.hi:
                return self.comm(out, part.send)
            splits = [
                max(0, min(part.hi, (r + 1) * b.chunk) - max(pc.lo, r * b.chunk)) for r in range(b.group.partitions)
            ]
            return self.comm.uneven(out, part.send, splits)

    def _launch_all_reduce(self, pc: _Piece, send: torch.Tensor) -> None:
        """Stage 0: average the whole piece in place."""
        with self.rt.comm_ctx.on(self.rt.comm_ctx.reduce_stream):  # CUDA: off the compute stream
            handle = self.comm(send, send)

        def finish(pc=pc, send=send):
            if send is not pc.grad:
                pc.grad.copy_(send)
            self._done(pc)

        self.handles.append((handle, finish))

    def _launch_own_chunk(self, pc: _Piece, part: _Part) -> None:
        """Stage 1: the shard is this rank's chunk of the full gradient buffer: the result is written there."""
        shard = self.shards[pc.bucket.group.index][part.at : part.at + part.e - part.a]
        self._stash(pc.bucket)
        # the reduced part lands on this rank's own part of the send buffer: in place when the dtypes allow
        # (the collective reads its input before it writes the output, as NCCL's in-place reduce-scatter)
        in_place = part.send is pc.grad and shard.dtype == self.reduce_dtype
        out = shard if in_place else scratch.take(part.e - part.a, self.reduce_dtype, part.send.device)
        handle = self._reduce(pc, part, out)

        def finish(pc=pc, out=out, shard=shard, a=part.a - part.base, e=part.e - part.base):
            pc.clean = False  # the local gradients are consumed: logically zero (the shard is written next)
            if out is not shard:
                shard.copy_(out)
                scratch.give(out)
            if pc.bucket in self.stashed:
                shard.add_(self.stashed[pc.bucket][a:e])
            self._done(pc)

        self.handles.append((handle, finish))

    def _launch_streamed(self, pc: _Piece, part: _Part) -> None:
        """Stage 3, one piece per unit: the chunk goes to the master store, nothing is kept. At most one reduction
        is in flight: the previous unit's lands (and is handed over) before this one starts, so host memory holds
        one unit's gradient in flight besides the one backward is filling; in place: this rank's part of the send
        buffer receives the result (the collective reads its input before it writes), so no output chunk is
        allocated per reduction."""
        self.land()
        out = part.send[part.a - pc.lo : part.e - pc.lo]
        handle = self._reduce(pc, part, out)

        def finish(pc=pc, out=out, at=part.at):
            if pc.whole and out.numel() == pc.bucket.chunk:
                self.rt.master.on_grad_ready(pc.bucket, out, self.boundary)  # copies ``out`` before returning
            elif out.numel():  # a piece's part of this rank's chunk, at shard offset ``at``
                self.rt.master.on_grad_ready(pc.bucket, out, self.boundary, start=at)
            self._drop_transient(pc)  # ``out`` is a view of the piece's buffer: back to the pool only now

        self.handles.append((handle, finish))
        self.stream_reductions += 1
        if self.rt.world == 1:  # nothing to overlap: hand it over now, not while the next gradient is computed
            self.land()

    def _launch_into_shard(self, pc: _Piece, part: _Part) -> None:
        """Stages 1-3 with a kept gradient shard: the result is added to it (written straight into it by the first
        reduction since ``zero_grad``: no temporary, no add)."""
        shard = self.shards[pc.bucket.group.index][part.at : part.at + part.e - part.a]
        direct = self.fresh and shard.dtype == self.reduce_dtype
        out = shard if direct else scratch.take(part.e - part.a, self.reduce_dtype, part.send.device)
        handle = self._reduce(pc, part, out)

        def finish(pc=pc, out=out, shard=shard):
            if out is not shard:
                shard.add_(out)
                scratch.give(out)
            pc.clean = False  # stage 1: the local gradients are consumed (logically zero from here)
            if pc.transient:
                self._drop_transient(pc)  # stages 2/3 keep only the shard
            self._done(pc)

        if pc.transient:
            self._in_flight.append((handle, lambda pc=pc: self._drop_transient(pc)))
        self.handles.append((handle, finish))

    def land(self) -> None:
        """Wait for the reductions in flight and hand them over (stage 3 with streamed gradients calls it before
        gathering a unit in backward, so a unit's gradient never coexists with the next unit's parameters)."""
        for done, then in self.handles:
            done.wait()
            then()
        self.handles.clear()
        self._in_flight.clear()

    def _settle(self, pc: _Piece) -> None:
        """Stages 0/1, a piece that will not be launched: its buffer must read as zero where logically zero (not
        a bucket whose own chunk holds a reduced value: that stays until it is stashed or stepped)."""
        if not pc.transient and pc.bucket not in self.reduced:
            self._zero_gaps(pc)

    def _zero_gaps(self, pc: _Piece) -> None:
        """Make every element of ``pc.grad`` meaningful: zero what no gradient was written into since the buffer
        was cleared (padding, unused or frozen slots, stale values of the last round)."""
        if pc.clean:
            return
        pos = 0
        for lo, hi in sorted(pc.filled.items()) + [(pc.hi - pc.lo, pc.hi - pc.lo)]:
            if lo > pos:
                for view, _ in self._spans(pc, pos, lo, pc.bucket.group.device):
                    view.zero_()
            pos = max(pos, hi)
        pc.filled = {}
        pc.clean = not pc.transient

    @staticmethod
    def _drop_transient(pc: _Piece) -> None:
        """Stages 2/3: the piece's gradient is reduced (its collective waited): its buffer goes back to the pool,
        so the next backward writes the same storage instead of faulting fresh pages in (a borrowed autograd
        gradient is only let go)."""
        if pc.grad is not None and not pc.borrowed:
            scratch.give(pc.grad)
        pc.grad, pc.borrowed = None, False

    def _done(self, pc: _Piece) -> None:
        """A piece's result is in the shard; once its bucket's last piece is, tell the master store."""
        b = pc.bucket
        self.pending[b] -= 1
        if self.pending[b]:
            return
        if b in self.own_chunk:
            self.stashed.pop(b, None)
            self.reduced.add(b)
        self.rt.master.on_grad_ready(b, self.shards[b.group.index][b.shard_slice()], self.boundary)

    def _stash(self, b: Bucket) -> None:
        """Stage 1 with the shard inside the full gradient buffer: before new local gradients land on a chunk
        that holds an already reduced value, move that value aside (added back when the next round finishes)."""
        if b not in self.reduced:
            return
        self.reduced.discard(b)
        own = self.shards[b.group.index]
        if b in self.stashed:
            self.stashed[b].add_(own)
        else:
            self.stashed[b] = own.clone()
        own.zero_()

    def begin_backward(self, is_boundary: bool | None) -> None:
        """Called by ``runtime.backward`` before autograd runs: decide whether this backward reduces."""
        if self.handles or self.next_launch or (self.stage >= 2 and self.dirty):
            self.finish_round()  # a previous backward ran outside runtime.backward and left a round open
        self.reduce_now = self.stage >= 2 or bool(is_boundary)
        self.boundary = is_boundary
        self._hook_trainable()
        for pc in self.active:
            pc.ready = 0

    def finish_round(self, final: bool = False) -> None:
        """Launch every piece not yet launched (fixed order), wait for all, add results into the shards.
        ``final``: ``step()`` follows (the master store is told ``boundary=True``)."""
        if final:
            self.boundary = True
        if not self.dirty and not self.handles:
            for pc in self.pieces:  # nothing arrived since zero(): the persistent buffers must read as zero
                self._settle(pc)
            return
        self.pending = {}
        for pc in self.active:
            self.pending[pc.bucket] = self.pending.get(pc.bucket, 0) + 1
        for pc in self.active[self.next_launch :]:
            if self.arrived[pc.bucket] < self.expected[pc.bucket]:
                self.arrived[pc.bucket] = self.expected[pc.bucket]  # told once
                self.rt.params.on_grads_done(pc.bucket)
            self._launch(pc)
        with record_function("zero::reduce"):
            for handle, finish in self.handles:
                handle.wait()
                finish()
        self.handles.clear()
        self._in_flight.clear()
        self._reset_round()
        self.dirty = False
        self.fresh = False

    def _reset_round(self) -> None:
        for pc in self.active:
            pc.launched = False
            pc.ready = 0
        self.arrived = dict.fromkeys(self.expected, 0)
        self.next_launch = 0

    def end_backward(self) -> None:
        """After autograd: stages 2/3 (and a boundary backward at 0/1) finish their round now."""
        if self.reduce_now:
            self.finish_round()
        self.reduce_now = self.stage >= 2

    def zero(self) -> None:
        """Drop accumulated gradients (after waiting for any collective in flight, so ranks stay matched)."""
        for handle, _ in self.handles:
            handle.wait()
        self.handles.clear()
        self._in_flight.clear()
        if self.streamed:  # the master store holds the accumulated gradients: it drops them too
            self.rt.master.drop_grads()
        for g in self.groups:
            if self.shards[g.index] is not None and not (
                self.stage == 0 or any(b in self.own_chunk for b in g.buckets)
            ):
                self.shards[g.index].zero_()  # (else the shard is part of the full buffer, cleared below)
        for bt in self.batches:
            self._give_batch(bt)
        for pc in self.pieces:
            pc.filled = {}
            if pc.transient:
                self._drop_transient(pc)
            else:  # stages 0/1: logically zero; the first gradient of each slot is copied in, gaps zeroed at launch
                pc.clean = False
        self._reset_round()
        self.dirty = False
        self.fresh = True
        self.reduced.clear()
        self.stashed.clear()
        for flags in self.got.values():
            flags[:] = [False] * len(flags)

    def has_grad(self) -> dict[int, list[bool]]:
        """Flat-group index -> per slot (``g.slots`` order): a gradient arrived on this rank since ``zero()``."""
        return self.got

    def close(self) -> None:
        """Detach every gradient hook (after waiting for collectives in flight)."""
        for handle, _ in self.handles:
            handle.wait()
        self.handles.clear()
        self._in_flight.clear()
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self.shards, self.grads = [], []
        for pc in self.pieces:
            pc.grad, pc.borrowed = None, False
        for bt in self.batches:
            bt.buf = None
