"""``zero_init()``: partition parameters while modules are constructed (DeepSpeed's ``zero.Init``, our design).

Each parameter is partitioned exactly once, when the outermost module construction in progress returns, i.e. after
the most-derived ``__init__`` of the top module being built: a subclass or an enclosing module can still
edit weights created by the ``__init__`` it called, and parameters made by mixins are included. The cost: one
top-level module is whole on each rank until its ``__init__`` returns, so build very large models as several
top-level constructions (e.g. layers built one by one into a ``ModuleList`` outside any ``__init__``).
The end of an ``__init__`` is observed with a profile function (``sys.setprofile``) while the context is active;
no torch factory and no class is patched, so ordinary code (``torch.arange`` for rotary tables, buffers of any
dtype) computes exactly what it computes outside the context. Buffers are never touched.

Partitioning broadcasts the parameter from the group's rank 0 (so every rank holds the same model), keeps this
rank's equal chunk (zero padded) in a record, and replaces ``param.data`` with an empty tensor: swapping ``.data``
is the only way to free a ``Parameter``'s memory while keeping the object the module and optimizer refer to. The
logical shape stays in the record (``logical_shape``). ``ZeroRuntime`` builds its buckets from these records
at every stage, one all-gather per bucket (``zero_core.materialize``). Use ``GatheredParameters`` to read or edit
them in between.
"""

from __future__ import annotations

import dis
import math
import sys

import torch
import torch.distributed as dist

from zero_comm import GroupOperationError, agree, broadcast
from zero_core.materialize import pin_host_mmap_threshold, return_freed_host_memory
from zero_core.partition_records import PartitionedParam, forget, gather_partitioned, partitioned_record, record
from zero_core.partitioned_param import adopt

# Full host values freed by partitioning go back to the OS every time this many bytes have been freed, counted across
# the modules of one construction (glibc keeps freed heap pages resident: without it the records are written to
# fresh pages while the freed values stay resident, and a model whose modules are each smaller than this kept its
# whole freed size until ``initialize``)
TRIM_BYTES = 4 * 2**20


def _chunk(numel: int, world: int) -> int:
    return max(1, math.ceil(numel / world))


@torch.no_grad()
def partition(p: torch.nn.Parameter, group, dtype: torch.dtype | None = None) -> PartitionedParam:
    """Partition ``p`` now (collective over ``group``); a parameter already partitioned is left as it is."""
    rec = partitioned_record(p)
    if rec is not None:
        return rec
    world, rank = group.size(), dist.get_rank(group)
    value = p.detach()
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    flat = value.contiguous().reshape(-1).clone()
    broadcast(flat, dist.get_global_rank(group, 0), group)
    chunk = _chunk(flat.numel(), world)
    padded = torch.zeros(chunk * world, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    rec = PartitionedParam(
        value.shape, flat.numel(), flat.dtype, padded[rank * chunk : (rank + 1) * chunk].clone(), group
    )
    p.data = torch.empty(0, dtype=flat.dtype, device=flat.device)  # free the full value; the record keeps the shape
    record(p, rec)
    adopt(p)  # ds_* properties read this record (zero_core.partitioned_param)
    return rec


@torch.no_grad()
def unpartition(p: torch.nn.Parameter) -> None:
    """Give ``p`` its full value back (collective) and drop its record."""
    if partitioned_record(p) is not None:
        p.data = gather_partitioned(p).clone()
        forget(p)


def _returned_normally(frame) -> bool:
    """At a profile "return" event: True for a ``return``, False when the frame is unwinding an exception."""
    lasti = frame.f_lasti  # a byte offset (Python 3.11+); 3.10 counts 2-byte code units
    ops = {i.offset: i.opname for i in dis.get_instructions(frame.f_code)}
    op = ops.get(lasti) if sys.version_info >= (3, 11) else ops.get(2 * lasti)
    return op is not None and op.startswith("RETURN")


class zero_init:  # noqa: N801 - used like a function: `with zero_init(): model = Model()`
    """Context manager: parameters of modules constructed inside are partitioned over ``group`` (None: WORLD).

    Args:
        group: the data-parallel process group.
        dtype: cast floating parameters to this dtype when partitioning (None: keep); buffers are untouched.
        on_partition: optional ``callable(param)`` run after each partition (instrumentation, tests).
        enabled: False makes the context a no-op.

    Not re-entrant across threads: construction must happen on the thread that entered the context. Code in a
    parent's ``__init__`` that reads a child's weights after the child was built must use ``GatheredParameters``.
    """

    def __init__(self, group=None, dtype: torch.dtype | None = None, on_partition=None, enabled: bool = True):
        self.group = group
        self.dtype = dtype
        self.on_partition = on_partition
        self.enabled = enabled
        self._building: dict[int, object] = {}
        self._finished: list[torch.nn.Module] = []
        self._previous = None
        self._agreed = False
        self._untrimmed = 0  # host bytes of full values freed since the last return to the OS

    def __enter__(self):
        if not self.enabled:
            return self
        self.group = self.group or dist.group.WORLD
        # before the first full value is freed: a freed mapped block would raise glibc's thresholds for the rest of
        # the process (see pin_host_mmap_threshold), and the heap laid out meanwhile stays fragmented
        pin_host_mmap_threshold()
        self._previous = sys.getprofile()
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            sys.setprofile(self._previous)
            if not self._agreed:  # a failure on any rank is the same error on every rank
                self._agree(exc[1])
        return False

    def _agree(self, error) -> None:
        try:
            agree("zero_init", error, self.group)
        except GroupOperationError:
            self._agreed = True
            raise

    def _profile(self, frame, event, arg):
        if self._previous is not None:
            self._previous(frame, event, arg)
        if frame.f_code.co_name != "__init__" or event not in ("call", "return"):
            return
        obj = frame.f_locals.get("self")
        if not isinstance(obj, torch.nn.Module):
            return
        if event == "call":
            self._building.setdefault(id(obj), frame)
        elif self._building.get(id(obj)) is frame:  # the outermost __init__ of this object returned
            del self._building[id(obj)]
            if self._building:  # an enclosing construction may still edit this module's weights
                self._finished.append(obj)
                return
            if not _returned_normally(frame):  # it raised: partition nothing; __exit__ tells the peers
                self._finished.clear()
                return
            self._agree(None)  # every rank built it, or every rank raises (before any broadcast)
            for m in self._finished:
                self._partition(m, last=False)
            self._partition(obj)
            self._finished.clear()

    def _partition(self, module: torch.nn.Module, last: bool = True) -> None:
        """Partition ``module``'s parameters not yet partitioned; ``last``: no module of this construction follows,
        so every freed byte goes back to the OS now."""
        for p in module.parameters():
            if partitioned_record(p) is None:
                freed = p.numel() * p.element_size() if p.device.type == "cpu" else 0
                partition(p, self.group, self.dtype)
                if self.on_partition is not None:
                    self.on_partition(p)
                self._untrimmed += freed
                self._trim(TRIM_BYTES)  # before the next records are written to fresh pages
        if last:
            self._trim(0)

    def _trim(self, at_least: int) -> None:
        """Give freed host pages back to the OS once more than ``at_least`` bytes of full values were freed."""
        if self._untrimmed > at_least:
            return_freed_host_memory()
            self._untrimmed = 0
