"""One bucket's starting values, with at most one collective.

Stage 3 (and zero_compile's parameter store) start by filling each bucket's full buffer with the model's weights,
identical on every rank. Parameters built under ``zero_init`` are already partitioned: each rank holds its chunk
of every parameter (rank 0's values, broadcast once at construction). Their bucket is then filled by ONE
all-gather of the concatenated chunks, with no broadcast: the values are the same on every rank already. A bucket
holding any parameter that is whole on each rank (built outside ``zero_init``) is filled locally and broadcast
from rank 0 once (DeepSpeed's stage 3 broadcasts rank 0's weights the same way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor, broadcast
from zero_core.layout import Bucket
from zero_core.partition_records import gather_partitioned, partitioned_record


def _same_ranks(a, b) -> bool:
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


@torch.no_grad()
def bucket_values(b: Bucket, group, dtype: torch.dtype, out: torch.Tensor) -> None:
    """Fill ``out`` (``b.padded_numel`` elements; its own dtype) with the bucket's parameters as ``dtype`` values,
    zero padding, the same on every rank of ``group``. Collective: one all-gather when every parameter of the
    bucket was partitioned by ``zero_init`` over the same ranks, else one broadcast from the group's rank 0."""
    recs = [partitioned_record(s.param) for s in b.slots]
    out.zero_()
    if recs and all(r is not None and r.shard is not None and _same_ranks(r.group, group) for r in recs):
        world = group.size()
        sizes = [r.shard.numel() for r in recs]
        send = torch.cat([r.shard.reshape(-1).to(dtype) for r in recs])
        every = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
        all_gather_into_tensor(every, send, group)
        rows = every.view(world, send.numel())
        pos = 0
        for s, n in zip(b.slots, sizes):  # parameter i is its chunk of every rank, in rank order, unpadded
            value = rows[:, pos : pos + n].reshape(-1)[: s.numel]
            out[s.bucket_offset : s.bucket_offset + s.numel] = value
            pos += n
        return
    for s in b.slots:
        # a bucket mixing both kinds: one gather per partitioned one; a deferred one computes its value here
        value = gather_partitioned(s.param, group)
        out[s.bucket_offset : s.bucket_offset + s.numel] = value.reshape(-1).to(dtype)
    broadcast(out, dist.get_global_rank(group, 0), group)


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def return_freed_host_memory() -> bool:
    """Give the host memory this process has freed back to the OS (glibc's ``malloc_trim(0)``): the freed pages of
    the zero_init records a unit replaced, which the heap would otherwise keep resident while the next unit's
    stored chunk is written to fresh pages. Returns False where glibc is absent (nothing done)."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
HOST_MMAP_THRESHOLD = 128 * 2**10  # glibc's own starting value of both
TRAINING_MMAP_THRESHOLD = 32 * 2**20  # the most glibc's dynamic threshold reaches on 64-bit hosts


class HostThresholds:
    """What this process set of glibc's mmap and trim thresholds (one per process: they are process-wide).

    Attributes:
        value: the bytes both thresholds were fixed at by zero, or None (glibc's own dynamic thresholds, or the
            user's choice through ``MALLOC_MMAP_THRESHOLD_`` / ``GLIBC_TUNABLES``, which zero never overrides).
        training: a training engine was built in this process; the thresholds stay at the training value.
    """

    def __init__(self):
        self.value: int | None = None
        self.training = False

    def _set(self, value: int) -> bool:
        if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
            return False
        libc = _libc()
        if libc is None or not (libc.mallopt(M_MMAP_THRESHOLD, value) and libc.mallopt(M_TRIM_THRESHOLD, value)):
            return False
        self.value = value
        return True

    def pin(self) -> bool:
        """Fix both thresholds at their starting value (128 KiB), so host allocations of that size or more are
        always mapped and go back to the OS when freed. glibc otherwise raises the mmap threshold to the size of each
        freed mapped block (up to 32 MiB) and the trim threshold to twice it: once a model's full values (zero_init)
        or a unit's full buffer (stage 3's release) have been freed, every smaller allocation, such as a forward's
        activations, comes from the heap, whose freed pages stay resident and fragment, so RSS grows far past what
        is live (``docs/benchmarks.md``, ZeRO-Inference). Not done once the process trains (:meth:`for_training`).
        Returns True when set; False where glibc is absent, the user chose a threshold, or the process trains."""
        return not self.training and self._set(HOST_MMAP_THRESHOLD)

    def for_training(self) -> bool:
        """A training engine is built: where zero pinned the thresholds, fix them at 32 MiB (the most glibc's
        dynamic threshold reaches) so that a step reuses freed heap for its activations and unit buffers instead of
        mapping and faulting in fresh pages at every allocation, which costs a stage-3 step about 15%
        (``docs/benchmarks.md``, stage 3's peak RSS); later pins are refused. glibc's own dynamic thresholds
        and the user's are left alone. Returns True when the thresholds were changed."""
        self.training = True
        return self.value == HOST_MMAP_THRESHOLD and self._set(TRAINING_MMAP_THRESHOLD)


HOST_THRESHOLDS = HostThresholds()
"""This process's :class:`HostThresholds`."""


def pin_host_mmap_threshold() -> bool:
    """``HOST_THRESHOLDS.pin()``: see :meth:`HostThresholds.pin`."""
    return HOST_THRESHOLDS.pin()
