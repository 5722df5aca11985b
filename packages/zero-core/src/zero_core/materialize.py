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
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def return_freed_host_memory() -> bool:
    """Give the host memory this process has freed back to the OS (glibc's ``malloc_trim(0)``): the freed pages of
    the zero_init records a unit replaced, which the heap would otherwise keep resident while the next unit's
    stored chunk is written to fresh pages. Returns False where glibc is absent (nothing done)."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))
