"""Stages 1/2: bring the model's parameters up to date after the optimizer stepped this rank's master shard.

One all-gather per bucket (this rank's chunk in, the bucket's full buffer out). With ``overlap_comm`` the
all-gathers are issued asynchronously after ``step()`` and each is waited for lazily, in a forward pre-hook of
the first module that owns a parameter of that bucket, so communication overlaps the next forward (DeepSpeed
stage 1/2 gathers synchronously at the end of ``step``; FSDP2 overlaps the same way with its unshard in the pre-
forward hook). Every other reader waits first: ``backward``, ``step``, ``full_parameters``, ``shards``, checkpoint
loads and :meth:`ParamSync.wait` (public as ``ZeroRuntime.wait_for_params``). A module that reads another
module's parameter directly must declare it with ``register_external_parameter`` so that its hook waits too.
"""

from __future__ import annotations

import weakref

import torch

from zero_comm import all_gather_into_tensor
from zero_core.layout import Bucket, FlatGroup


class ParamSync:
    """Per-bucket parameter all-gathers of one stage-0/1/2 runtime (see the module docstring)."""

    def __init__(self, groups: list[FlatGroup], module: torch.nn.Module, comm_group, param_dtype, lazy: bool):
        self.groups = groups
        self.comm_group = comm_group
        self.param_dtype = param_dtype
        self.lazy = lazy
        self.pending: dict[Bucket, tuple] = {}
        self.needs: dict[torch.nn.Module, list[Bucket]] = {}
        self._hooks = []
        if lazy:
            owner = {id(s.param): b for g in groups for b in g.buckets for s in b.slots}
            for m in module.modules():
                units = []
                for p in m.parameters(recurse=False):
                    b = owner.get(id(p))
                    if b is not None and b not in units:
                        units.append(b)
                if units:
                    self._add(m, units)
        self._owner = {id(s.param): b for g in groups for b in g.buckets for s in b.slots}
        me = weakref.ref(self)
        _REGISTRY.update({k: (me, weakref.ref(s.param)) for g in groups for s in g.slots for k in [id(s.param)]})

    def _add(self, m: torch.nn.Module, units: list[Bucket]) -> None:
        if m not in self.needs:
            self.needs[m] = []
            self._hooks.append(m.register_forward_pre_hook(lambda mod, args: self.wait(self.needs[mod])))
        self.needs[m] += [b for b in units if b not in self.needs[m]]

    def register_external(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        """``module``'s forward reads ``param`` (owned elsewhere): its pre-hook waits for that bucket too."""
        b = self._owner.get(id(param))
        if b is not None and self.lazy:
            self._add(module, [b])

    def refresh(self) -> None:
        """All-gather each trainable bucket from its master chunk (async when lazy); non-lazy waits at once."""
        self.wait()
        for g in self.groups:
            if g.group_index is None or not g.buckets:
                continue
            if g.partitions == 1 and g.master.data_ptr() == g.buckets[0].full.data_ptr():
                continue  # stage 0 fp32: the optimizer stepped the model's own buffer
            for b in g.buckets:
                src = g.master[b.shard_offset : b.shard_offset + b.chunk].detach().to(self.param_dtype)
                if src.untyped_storage().data_ptr() == b.full.untyped_storage().data_ptr():
                    src = src.clone()  # the master is a view of b.full: never hand a collective aliased buffers
                if g.partitions == 1:
                    b.full.copy_(src)
                    continue
                tmp = None if self.param_dtype == b.full.dtype else torch.empty(
                    b.padded_numel, dtype=self.param_dtype, device=g.device
                )  # fmt: skip
                out = b.full if tmp is None else tmp
                self.pending[b] = (all_gather_into_tensor(out, src, self.comm_group, async_op=True), tmp)
        if not self.lazy:
            self.wait()

    def wait(self, buckets: list[Bucket] | None = None) -> None:
        """Finish the pending all-gathers of ``buckets`` (None: all), in issue order."""
        if not self.pending:
            return
        todo = list(self.pending) if buckets is None else [b for b in buckets if b in self.pending]
        if buckets is not None and todo:  # earlier-issued gathers complete first anyway: take them along
            last = max(list(self.pending).index(b) for b in todo)
            todo = list(self.pending)[: last + 1]
        for b in todo:
            handle, tmp = self.pending.pop(b)
            handle.wait()
            if tmp is not None:
                b.full.copy_(tmp)

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


_REGISTRY: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id(param) -> weak references to (its ParamSync, the parameter), for ``register_external_parameter``."""


def lookup(p: torch.Tensor) -> ParamSync | None:
    """The live ParamSync that gathers ``p``, or None (ids can be reused: the parameter itself is compared)."""
    entry = _REGISTRY.get(id(p))
    if entry is None or entry[1]() is not p:
        return None
    return entry[0]()
