"""Gradient reduction: per-parameter hooks fill bucket buffers; a full bucket launches its collective.

Stage 0 all-reduces (average) each bucket; stages 1-3 reduce-scatter it, each rank adding its chunk into its
gradient shard (``grad_shard(g)``, the optimizer's ``.grad``). Buckets launch strictly in one fixed order (the
order backward normally produces them), so every rank issues the same collectives in the same order even when
ranks use different parameters (ZC-10): a bucket whose gradients are not all ready when backward ends is launched
anyway, its missing gradients counting as zero (DeepSpeed's treatment of unused parameters).

Stages 2 and 3 reduce every backward (micro-batch) and keep only the shard. Stages 0 and 1 keep the full local
gradient and reduce only when a backward is marked as the accumulation boundary, or at ``step()`` otherwise; in
both cases nothing a backward produced is ever dropped (ZC-02). Reductions are linear, so reducing several times
before one step gives the same sum.
"""

from __future__ import annotations

import weakref

import torch
from torch.profiler import record_function

from zero_core.grad_reduction import GradComm, default_grad_comm
from zero_core.layout import Bucket, FlatGroup


class GradReducer:
    """Owns the gradient hooks and reduction rounds of one runtime (see the module docstring); implements
    ``zero_core.grad_reduction.GradReduction``.

    Runtime state it owns (the layout is frozen): per flat group (``FlatGroup.index``) the gradient shard; per
    bucket (lists indexed by ``Bucket.index``) its gradient buffer, how many gradients it expects and has, and
    whether its collective was launched this round.

    Args:
        comm: the bucket collective (``zero_core.grad_reduction.GradComm``); None: chosen from the config by
            ``default_grad_comm``.
    """

    def __init__(self, comm: GradComm | None = None):
        self.comm = comm
        self._hooks: dict[int, object] = {}  # id(slot) -> hook handle (kept so close() removes them)

    def attach(self, rt) -> None:
        """Allocate gradient buffers for every trainable flat group and hook its parameters."""
        self.rt = rt
        p = rt.precision
        stage = self.stage = rt.stage
        self.comm = self.comm or default_grad_comm(rt)
        self.reduce_dtype, self.accum_dtype = p.reduce, p.accum
        self.groups = [g for g in rt.flat_groups if g.group_index is not None]
        # Backward meets the last parameters first: launch order is reverse flat order.
        self.order: list[Bucket] = [b for g in self.groups for b in reversed(g.buckets) if b.slots]
        self.order.sort(key=lambda b: -max(s.param_index for s in b.slots))
        self.next_launch = 0
        self.reduce_now = stage >= 2
        self.boundary: bool | None = None
        self.dirty = False  # some gradient arrived since the last completed round
        self.handles: list = []
        self.fresh = True  # every gradient shard is zero (nothing reduced since zero())
        self.own_chunk: set[Bucket] = set()  # stage 1: buckets whose shard is a view of their full gradient
        self.reduced: set[Bucket] = set()  # ... whose own chunk holds a reduced (not local) value
        self.stashed: dict[Bucket, torch.Tensor] = {}  # reduced values moved aside for a further round
        self.got = {g.index: [False] * len(g.slots) for g in self.groups}  # a gradient arrived since zero()
        self._slot_index = {id(s): i for g in self.groups for i, s in enumerate(g.slots)}
        n = sum(len(g.buckets) for g in rt.flat_groups)
        self.shards: list[torch.Tensor | None] = [None] * len(rt.flat_groups)  # FlatGroup.index -> grad shard
        self.grads: list[torch.Tensor | None] = [None] * n  # Bucket.index -> its gradient buffer
        self.expected, self.ready, self.launched = [0] * n, [0] * n, [False] * n
        for g in self.groups:
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
        self._hook_trainable()

    def grad_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """This rank's accumulated gradient shard of ``g`` (None for a frozen group, or after ``close()``)."""
        return self.shards[g.index] if g.index < len(self.shards) else None

    def resident(self) -> list[torch.Tensor]:
        """The gradient shards and bucket buffers held now."""
        return [t for t in self.shards + self.grads if t is not None]

    def _hook_trainable(self) -> None:
        """Hook every parameter that requires grad now and has no hook yet; a bucket expects the gradients of
        its hooked parameters (``requires_grad`` may change after initialisation: HV-03)."""
        for g in self.groups:
            for b in g.buckets:
                for s in b.slots:
                    if s.trainable and s.numel > 0 and id(s) not in self._hooks:
                        self._hooks[id(s)] = s.param.register_post_accumulate_grad_hook(self._hook(b, s))
                self.expected[b.index] = sum(1 for s in b.slots if s.trainable and s.numel > 0)
        # every rank launches the same buckets in the same order (requires_grad must agree across ranks, as DDP)
        self.active = [b for b in self.order if self.expected[b.index] > 0]

    def _hook(self, bucket: Bucket, slot):
        index = self._slot_index[id(slot)]
        # Weak references only: the hook lives on the parameter (in C++, where the garbage collector cannot see
        # it), so a strong one would keep a dropped runtime alive through its own parameters.
        me, bucket_ref, slot_ref = weakref.ref(self), weakref.ref(bucket), weakref.ref(slot)

        def hook(param: torch.Tensor) -> None:
            reducer, b, s = me(), bucket_ref(), slot_ref()
            if reducer is not None and b is not None and s is not None:
                reducer._accumulate(param, b, s, index)

        return hook

    def _accumulate(self, param: torch.Tensor, bucket: Bucket, slot, index: int) -> None:
        """``param``'s gradient is ready: add it into its bucket, launch the bucket when it is complete."""
        grad = param.grad
        param.grad = None  # the bucket owns the gradient from here on
        i = bucket.index
        if self.launched[i]:  # a new micro-batch began before the last round was finished
            self.finish_round()
        self._stash(bucket)
        buf = self.grads[i]
        if buf is None:
            buf = self.grads[i] = torch.zeros(bucket.padded_numel, dtype=self.reduce_dtype, device=grad.device)
        buf[slot.bucket_offset : slot.bucket_offset + slot.numel].add_(grad.reshape(-1))
        self.ready[i] += 1
        self.got[bucket.group.index][index] = True
        self.dirty = True
        if self.reduce_now and self.ready[i] >= self.expected[i]:
            self.rt.params.on_grads_done(bucket)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.active):
            b = self.active[self.next_launch]
            if self.ready[b.index] < self.expected[b.index]:
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        self.next_launch += 1
        self.launched[b.index] = True
        buf = self.grads[b.index]
        if buf is None:  # no parameter of this bucket was used this micro-batch on this rank
            buf = self.grads[b.index] = torch.zeros(b.padded_numel, dtype=self.reduce_dtype, device=b.group.device)
        send = buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)
        g = b.group
        own = self.shards[g.index]
        shard = own[b.shard_slice()]
        if not self.comm.scatters:
            handle = self.comm(send, send)

            def finish(b=b, send=send, buf=buf):
                if send is not buf:
                    buf.copy_(send)
                self._ready(b)
        elif b in self.own_chunk:
            # stage 1, the shard is this rank's chunk of the full gradient buffer: write the result there
            self._stash(b)
            out = torch.empty(b.chunk, dtype=self.reduce_dtype, device=send.device)
            handle = self.comm(out, send)

            def finish(b=b, out=out, own=own, buf=buf):
                buf.zero_()
                own.copy_(out)
                if b in self.stashed:
                    own.add_(self.stashed.pop(b))
                self.reduced.add(b)
                self._ready(b)
        else:
            direct = self.fresh and shard.dtype == self.reduce_dtype
            # the first reduction since zero_grad writes straight into the (zero) shard: no temporary, no add
            out = shard if direct else torch.empty(b.chunk, dtype=self.reduce_dtype, device=send.device)
            handle = self.comm(out, send)

            def finish(b=b, out=out, shard=shard, buf=buf):
                if out is not shard:
                    shard.add_(out)
                if self.stage == 1:
                    buf.zero_()
                else:
                    self.grads[b.index] = None  # stages 2/3 keep only the shard
                self._ready(b)

        self.handles.append((handle, finish))

    def _ready(self, b: Bucket) -> None:
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
        for b in self.active:
            self.ready[b.index] = 0

    def finish_round(self, final: bool = False) -> None:
        """Launch every bucket not yet launched (fixed order), wait for all, add results into the shards.
        ``final``: ``step()`` follows (the master store is told ``boundary=True``)."""
        if final:
            self.boundary = True
        if not self.dirty and not self.handles:
            return
        for b in self.active[self.next_launch :]:
            if self.ready[b.index] < self.expected[b.index]:
                self.rt.params.on_grads_done(b)
            self._launch(b)
        with record_function("zero::reduce"):
            for handle, finish in self.handles:
                handle.wait()
                finish()
        self.handles.clear()
        for b in self.active:
            self.launched[b.index] = False
            self.ready[b.index] = 0
        self.next_launch = 0
        self.dirty = False
        self.fresh = False

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
        for g in self.groups:
            self.shards[g.index].zero_()
            for b in g.buckets:
                if self.stage <= 1:
                    self.grads[b.index].zero_()
                else:
                    self.grads[b.index] = None
                self.launched[b.index], self.ready[b.index] = False, 0
        self.next_launch = 0
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
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        self.shards, self.grads = [], []
