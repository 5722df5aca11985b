"""``zero_init()``: partition parameters while modules are constructed (DeepSpeed's ``zero.Init``, our design).

Each module's parameters are partitioned as that module's ``__init__`` returns (the outermost ``__init__`` running
for that object, so a subclass's ``__init__`` and the mixins it calls come first), as DeepSpeed's ``zero.Init``
does: while a model is built, each rank holds its shard of what is built plus the module being built, never the
whole model. Code that runs later in an enclosing ``__init__`` and writes or reads a partitioned parameter (a
subclass editing its parent's weights, Hugging Face's ``post_init`` initialising every weight at the end of the
top model's ``__init__``) sees what a dense build sees: ``zero_core.build_access`` gathers that one parameter and
partitions it again, so the values equal a dense build's bitwise, random initialisation included.
The end of an ``__init__`` is observed with a profile function (``sys.setprofile``) while the context is active;
no torch factory and no class is patched, so ordinary code (``torch.arange`` for rotary tables, buffers of any
dtype) computes exactly what it computes outside the context. Buffers are never touched.

Partitioning broadcasts the parameter from the group's rank 0 (so every rank holds the same model), keeps this
rank's equal chunk (zero padded) in a record, and replaces ``param.data`` with an empty tensor: swapping ``.data``
is the only way to free a ``Parameter``'s memory while keeping the object the module and optimizer refer to. The
logical shape stays in the record (``logical_shape``). ``ZeroRuntime`` builds its buckets from these records
at every stage, one all-gather per bucket (``zero_core.materialize``). Use ``GatheredParameters`` to read or edit
them between the context and the runtime.
"""

from __future__ import annotations

import dis
import math
import sys

import torch
import torch.distributed as dist

from zero_comm import GroupOperationError, agree, broadcast
from zero_core.build_access import BuildAccess
from zero_core.materialize import pin_host_mmap_threshold, return_freed_host_memory
from zero_core.partition_records import PartitionedParam, forget, gather_partitioned, partitioned_record, record
from zero_core.partitioned_param import adopt, held_numel, set_released_access

# Full host values freed by partitioning go back to the OS every time this many bytes have been freed, counted across
# the modules of one construction (glibc keeps freed heap pages resident: without it the records are written to
# fresh pages while the freed values stay resident, and a model whose modules are each smaller than this kept its
# whole freed size until ``initialize``)
TRIM_BYTES = 4 * 2**20


def _chunk(numel: int, world: int) -> int:
    return max(1, math.ceil(numel / world))


@torch.no_grad()
def partition(p: torch.nn.Parameter, group, dtype: torch.dtype | None = None) -> PartitionedParam:
    """Partition ``p`` now (collective over ``group``: rank 0's value is kept); a parameter already partitioned is
    left as it is. Each rank holds at most ``p``'s full value and its shard at once: rank 0 sends its value as it
    is, the other ranks free theirs before receiving (their own values are never written to, as other tensors may
    share their memory)."""
    rec = partitioned_record(p)
    if rec is not None:
        return rec
    world, rank = group.size(), dist.get_rank(group)
    value = p.detach()
    if dtype is not None and value.is_floating_point():
        value = value.to(dtype)
    shape, numel, kind, device = value.shape, value.numel(), value.dtype, value.device
    if rank == 0:
        flat = value.contiguous().reshape(-1)
    else:  # replaced by rank 0's value: free this rank's first
        del value
        p.data = torch.empty(0, dtype=kind, device=device)
        flat = torch.empty(numel, dtype=kind, device=device)
    broadcast(flat, dist.get_global_rank(group, 0), group)
    chunk = _chunk(numel, world)
    lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
    shard = torch.zeros(chunk, dtype=kind, device=device)  # zero padded past the value's end
    shard[: hi - lo] = flat[lo:hi]
    del flat
    rec = PartitionedParam(shape, numel, kind, shard, group)
    p.data = torch.empty(0, dtype=kind, device=device)  # free the full value; the record keeps the shape
    record(p, rec)
    adopt(p)  # a released ZeroParameter: ds_* properties read this record (zero_core.partitioned_param)
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
    """Context manager: parameters of modules constructed inside are partitioned over ``group`` (None: WORLD), each
    module's as its ``__init__`` returns.

    Args:
        group: the data-parallel process group.
        dtype: cast floating parameters to this dtype when partitioning (None: keep); buffers are untouched.
        on_partition: optional ``callable(param)`` run after each parameter's first partition (instrumentation,
            tests).
        enabled: False makes the context a no-op.

    Not re-entrant across threads: construction must happen on the thread that entered the context. Writes into a
    partitioned parameter inside the context land, and reads during a construction see its full value
    (``zero_core.build_access``); after the context, use ``GatheredParameters``.

    Raises:
        GroupOperationError: a construction failed on some rank (raised on every rank, at the next collective).
    """

    def __init__(self, group=None, dtype: torch.dtype | None = None, on_partition=None, enabled: bool = True):
        self.group = group
        self.dtype = dtype
        self.on_partition = on_partition
        self.enabled = enabled
        self._building: dict[int, object] = {}  # id(module) -> frame of its outermost __init__, innermost last
        self._whole: dict[int, list[torch.nn.Parameter]] = {}  # id(module) -> parameters to partition again
        self._access = BuildAccess(self)
        self._previous = None
        self._previous_access = None
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
        self._previous_access = set_released_access(self._access)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            sys.setprofile(self._previous)
            set_released_access(self._previous_access)
            # a failure on any rank is the same error on every rank (one agreed already is, on every rank)
            if not self._agreed and not isinstance(exc[1], GroupOperationError):
                self._agree(exc[1])
            self._trim(0)
        return False

    def _agree(self, error) -> None:
        try:
            agree("zero_init", error, self.group)
        except GroupOperationError:
            self._agreed = True
            raise

    # the Construction protocol of zero_core.build_access
    def building(self) -> bool:
        return bool(self._building)

    def keep_whole(self, p: torch.nn.Parameter) -> None:
        self._whole.setdefault(next(reversed(self._building)), []).append(p)

    def freed(self, nbytes: int) -> None:
        self._untrimmed += nbytes
        self._trim(TRIM_BYTES)

    def partition(self, p: torch.nn.Parameter) -> PartitionedParam:
        value_dtype = p.dtype
        rec = partition(p, self.group, self.dtype)
        if rec.dtype != value_dtype:
            rec.built_dtype = value_dtype  # a write during the build is made in it, then cast (build_access)
        return rec

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
            whole = self._whole.pop(id(obj), [])
            if not _returned_normally(frame):  # it raised: partition nothing; __exit__ tells the peers
                if self._building:  # unless an enclosing __init__ catches it, it partitions them
                    self._whole.setdefault(next(reversed(self._building)), []).extend(whole)
                return
            self._partition(obj, whole)

    def _partition(self, module: torch.nn.Module, whole: list[torch.nn.Parameter]) -> None:
        """Partition ``module``'s parameters not yet partitioned (its own, and any of its children's added since
        their construction) and partition ``whole`` again (parameters gathered for a view during it)."""
        new = [p for p in module.parameters() if partitioned_record(p) is None]
        again = [p for p in whole if _held_whole(p)]
        if new or again or not self._building:
            self._agree(None)  # every rank built it, or every rank raises (before any broadcast)
        for p in again:
            self._access.repartition(p)
        for p in new:
            if partitioned_record(p) is None:  # a parameter tied twice in the module is partitioned once
                freed = p.numel() * p.element_size() if p.device.type == "cpu" else 0
                self.partition(p)
                if self.on_partition is not None:
                    self.on_partition(p)
                self.freed(freed)  # before the next records are written to fresh pages
        if not self._building:
            self._trim(0)

    def _trim(self, at_least: int) -> None:
        """Give freed host pages back to the OS once more than ``at_least`` bytes of full values were freed."""
        if self._untrimmed > at_least:
            return_freed_host_memory()
            self._untrimmed = 0


def _held_whole(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` has a ``zero_init`` record and holds its full value (gathered for a view, not released)."""
    rec = partitioned_record(p)
    return rec is not None and rec.shard is not None and held_numel(p) == rec.numel
