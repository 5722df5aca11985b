"""Gradient reduction: per-parameter hooks fill bucket buffers; a full bucket launches its collective.

Stage 0 all-reduces (average) each bucket; stages 1-3 reduce-scatter it, each rank adding its chunk into its
gradient shard (``FlatGroup.grad``, the optimizer's ``.grad``). Buckets launch strictly in one fixed order (the
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
from zero_core.layout import Bucket


class GradReducer:
    """Owns the gradient hooks and reduction rounds of one runtime (see the module docstring); implements
    ``zero_core.grad_reduction.GradReduction``.

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
        for g in self.groups:
            g.grad = torch.zeros(g.shard_numel, dtype=self.accum_dtype, device=g.device)
            if stage <= 1:  # full local gradients, persistent
                full = torch.zeros(g.padded_numel, dtype=self.accum_dtype, device=g.device)
                pos = 0
                for b in g.buckets:
                    b.grad = full[pos : pos + b.padded_numel]
                    pos += b.padded_numel
                if stage == 0:
                    g.grad = full  # one partition: the reduced full buffer is the accumulator
                elif len(g.buckets) == 1:  # ZeRO formula: the shard is this rank's chunk of the full buffer
                    g.grad = g.buckets[0].grad[slice(*g.buckets[0].chunk_range(g.rank))]
                    self.own_chunk.add(g.buckets[0])
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        """Hook every parameter that requires grad now and has no hook yet; a bucket expects the gradients of
        its hooked parameters (``requires_grad`` may change after initialisation: HV-03)."""
        for g in self.groups:
            for b in g.buckets:
                for s in b.slots:
                    if s.trainable and s.numel > 0 and id(s) not in self._hooks:
                        self._hooks[id(s)] = s.param.register_post_accumulate_grad_hook(self._hook(b, s))
                b.expected_grads = sum(1 for s in b.slots if s.trainable and s.numel > 0)
        # every rank launches the same buckets in the same order (requires_grad must agree across ranks, as DDP)
        self.active = [b for b in self.order if b.expected_grads > 0]

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
        if bucket.launched:  # a new micro-batch began before the last round was finished
            self.finish_round()
        self._stash(bucket)
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.padded_numel, dtype=self.reduce_dtype, device=grad.device)
        bucket.grad[slot.bucket_offset : slot.bucket_offset + slot.numel].add_(grad.reshape(-1))
        bucket.ready_grads += 1
        self.got[bucket.group.index][index] = True
        self.dirty = True
        if self.reduce_now and bucket.ready_grads >= bucket.expected_grads:
            self.rt.params.on_grads_done(bucket)
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.active):
            b = self.active[self.next_launch]
            if b.ready_grads < b.expected_grads:
                return
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        self.next_launch += 1
        b.launched = True
        if b.grad is None:  # no parameter of this bucket was used this micro-batch on this rank
            b.grad = torch.zeros(b.padded_numel, dtype=self.reduce_dtype, device=b.group.device)
        send = b.grad if b.grad.dtype == self.reduce_dtype else b.grad.to(self.reduce_dtype)
        g = b.group
        shard = g.grad[b.shard_offset : b.shard_offset + b.chunk]
        if not self.comm.scatters:
            handle = self.comm(send, send)

            def finish(b=b, send=send):
                if send is not b.grad:
                    b.grad.copy_(send)
                self._ready(b)
        elif b in self.own_chunk:
            # stage 1, the shard is this rank's chunk of the full gradient buffer: write the result there
            self._stash(b)
            out = torch.empty(b.chunk, dtype=self.reduce_dtype, device=send.device)
            handle = self.comm(out, send)

            def finish(b=b, out=out, g=g):
                b.grad.zero_()
                g.grad.copy_(out)
                if b in self.stashed:
                    g.grad.add_(self.stashed.pop(b))
                self.reduced.add(b)
                self._ready(b)
        else:
            direct = self.fresh and shard.dtype == self.reduce_dtype
            # the first reduction since zero_grad writes straight into the (zero) shard: no temporary, no add
            out = shard if direct else torch.empty(b.chunk, dtype=self.reduce_dtype, device=send.device)
            handle = self.comm(out, send)

            def finish(b=b, out=out, shard=shard):
                if out is not shard:
                    shard.add_(out)
                if self.stage == 1:
                    b.grad.zero_()
                else:
                    b.grad = None  # stages 2/3 keep only the shard
                self._ready(b)

        self.handles.append((handle, finish))

    def _ready(self, b: Bucket) -> None:
        g = b.group
        self.rt.master.on_grad_ready(b, g.grad[b.shard_offset : b.shard_offset + b.chunk], self.boundary)

    def _stash(self, b: Bucket) -> None:
        """Stage 1 with the shard inside the full gradient buffer: before new local gradients land on a chunk
        that holds an already reduced value, move that value aside (added back when the next round finishes)."""
        if b not in self.reduced:
            return
        self.reduced.discard(b)
        own = b.group.grad
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
            b.ready_grads = 0

    def finish_round(self, final: bool = False) -> None:
        """Launch every bucket not yet launched (fixed order), wait for all, add results into the shards.
        ``final``: ``step()`` follows (the master store is told ``boundary=True``)."""
        if final:
            self.boundary = True
        if not self.dirty and not self.handles:
            return
        for b in self.active[self.next_launch :]:
            if b.ready_grads < b.expected_grads:
                self.rt.params.on_grads_done(b)
            self._launch(b)
        with record_function("zero::reduce"):
            for handle, finish in self.handles:
                handle.wait()
                finish()
        self.handles.clear()
        for b in self.active:
            b.launched = False
            b.ready_grads = 0
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
            g.grad.zero_()
            for b in g.buckets:
                if self.stage <= 1:
                    b.grad.zero_()
                else:
                    b.grad = None
                b.launched, b.ready_grads = False, 0
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
