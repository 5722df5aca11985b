"""Scratch buffers: the same storage comes back for the same size; gloo reduce-scatters reuse their receive buffer
from step to step and still give the reference result."""

import pytest
import torch
import torch.distributed as dist

from zero_comm import reduce_scatter_tensor, reduce_scatter_uneven
from zero_comm.buffers import DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY, BufferPool, scratch
from zero_comm.testing import run_ranks


def test_pool_gives_back_the_same_storage_by_exact_size():
    pool = BufferPool(max_idle_bytes=1000, per_key=1)
    a = pool.take(10, torch.float32)
    assert a.shape == (10,) and a.dtype == torch.float32 and pool.allocated == 1
    ptr = a.data_ptr()
    pool.give(a)
    pool.give(a)  # twice: still one idle entry, never handed to two callers
    assert pool.idle_bytes == 40
    assert pool.take(10, torch.float32).data_ptr() == ptr and pool.reused == 1
    assert pool.take(10, torch.float32).data_ptr() != ptr  # the pool was empty: a new buffer
    assert pool.take(10, torch.float64).dtype == torch.float64 and pool.allocated == 3  # dtype is part of the key
    # past the limits a buffer given back is dropped
    b, c = pool.take(10, torch.float32), pool.take(10, torch.float32)
    pool.give(b)
    pool.give(c)  # per_key 1
    assert pool.idle_bytes == 40
    pool.give(pool.take(300, torch.float32))  # 1200 bytes > max_idle_bytes
    assert pool.idle_bytes == 40
    pool.give(torch.zeros(4, 4))  # not a flat buffer: ignored
    pool.give(torch.zeros(8)[2:])  # a view into another buffer: ignored
    assert pool.idle_bytes == 40
    pool.clear()
    assert pool.idle_bytes == 0
    with pytest.raises(ValueError, match="max_idle_bytes"):
        BufferPool(max_idle_bytes=-1)


def _steps_body(steps: int):
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    # a warm worker may have run an NVMe-offload test before, which keeps no idle buffer
    scratch.max_idle_bytes, scratch.per_key = DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY
    scratch.clear()
    start = (scratch.allocated, scratch.reused)
    counts, errors = [], []
    for step in range(steps):
        x = torch.arange(world * 1000, dtype=torch.float32) * (rank + 1 + step)
        out = torch.empty(1000)
        reduce_scatter_tensor(out, x, group, algorithm="all_to_all", async_op=True).wait()
        scale = sum(r + 1 + step for r in range(world))
        want = torch.arange(rank * 1000, (rank + 1) * 1000, dtype=torch.float32) * scale
        errors.append((out - want).abs().max().item())
        splits = [300, 700]
        part = torch.empty(splits[rank])
        y = torch.ones(1000) * (rank + 1)
        reduce_scatter_uneven(part, y, splits, group, algorithm="all_to_all")
        errors.append((part - sum(r + 1 for r in range(world))).abs().max().item())
        counts.append((scratch.allocated - start[0], scratch.reused - start[1]))
    return counts, errors


def test_reduce_scatter_receive_buffers_reused_across_steps():
    for counts, errors in run_ranks(_steps_body, 2, 3, timeout=60):
        assert max(errors) == 0.0
        # step 1 allocates one receive buffer per collective; later steps take the same ones back
        assert counts[0] == (2, 0)
        assert counts[1:] == [(2, 2), (2, 4)], counts
