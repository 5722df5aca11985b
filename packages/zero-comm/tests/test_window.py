"""Shared-memory windows (zero_comm.window) on 1-3 gloo ranks: one-sided reads equal an all-gather, fences order
writes before reads, and ranks that cannot share memory all get None."""

import os

import pytest
import torch
import torch.distributed as dist

from zero_comm import CommsLogger, all_gather_into_tensor
from zero_comm.testing import run_ranks
from zero_comm.window import shared_window


def _values(rank: int, numel: int, step: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank)).to(dtype)


def _gather_body(numel, dtype_name):
    dtype = getattr(torch, dtype_name)
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    win = shared_window(group, numel, dtype)
    assert win is not None and win.local.numel() == numel and win.local.dtype == dtype
    zero_at_start = bool((win.local == 0).all())
    out = []
    for step in range(3):  # write, fence, read; the next write waits for a fence after the reads
        win.local.copy_(_values(rank, numel, step, dtype))
        win.fence()
        for start, count in ((0, numel), (3, numel - 5), (numel - 1, 1), (0, 0)):
            got = torch.full((world * count,), float("nan"), dtype=torch.float32)  # cast on the way, as bf16 -> fp32
            with CommsLogger() as log:
                win.gather(got, start, count)
            want = torch.empty(world * count, dtype=dtype)
            all_gather_into_tensor(want, win.local[start : start + count].contiguous(), group)
            out.append((bool(torch.equal(got, want.float())), log.records[0].algorithm, log.records[0].wire_bytes,
                        (world - 1) * count * win.local.element_size()))  # fmt: skip
        win.fence()
    return zero_at_start, out, win.fences


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (3, "float32"), (2, "bfloat16")])
def test_window_gather_equals_all_gather(world, dtype):
    for zero_at_start, out, fences in run_ranks(_gather_body, world, 1001, dtype, timeout=120):
        assert zero_at_start and fences == 6
        for equal, algorithm, wire, want_wire in out:
            assert equal and algorithm == "window" and wire == want_wire


def _fence_body():
    """Rank 0 writes late; rank 1 reads right after the fence: it must see rank 0's new values."""
    import time

    group = dist.new_group([0, 1], backend="gloo")
    win = shared_window(group, 64, torch.float32)
    rank = dist.get_rank()
    win.local.fill_(-1.0)
    win.fence()
    if rank == 0:
        time.sleep(1.0)  # rank 1 is already waiting in the fence below
        win.local.fill_(7.0)
    win.fence()
    return win.peer(0).clone(), win.peer(1).clone()


def test_fence_orders_a_late_write_before_the_peer_read():
    for p0, p1 in run_ranks(_fence_body, 2, timeout=60):
        assert torch.equal(p0, torch.full((64,), 7.0)) and torch.equal(p1, torch.full((64,), -1.0))


def _none_body(disable):
    if disable:
        os.environ["ZERO_COMM_SHM"] = "0"
    try:
        group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
        win = shared_window(group, 10, torch.float32)
        # the group still works afterwards (nothing half set up)
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return win is None, float(t)
    finally:
        os.environ.pop("ZERO_COMM_SHM", None)


def test_no_window_on_one_rank_or_when_disabled_on_one_rank():
    assert run_ranks(_none_body, 1, False, timeout=60) == [(True, 1.0)]

    def each(rank_disables):  # run_ranks passes the same args to every rank: pick by rank inside
        return run_ranks(_none_by_rank, 2, rank_disables, timeout=60)

    assert each(1) == [(True, 2.0), (True, 2.0)]  # one rank cannot map: every rank gets None, agreed


def _none_by_rank(rank_disables):
    return _none_body(dist.get_rank() == rank_disables)


def _bad_body():
    group = dist.new_group([0, 1], backend="gloo")
    win = shared_window(group, 8, torch.float32)
    errors = []
    for out, start, count in ((torch.empty(15), 0, 8), (torch.empty(4), 7, 2), (torch.empty(2), -1, 1)):
        try:
            win.gather(out, start, count)
        except ValueError as exc:
            errors.append(str(exc))
    try:
        shared_window(group, -1, torch.float32)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_bad_ranges_name_the_sizes():
    for errors in run_ranks(_bad_body, 2, timeout=60):
        assert len(errors) == 4
        assert "out has 15 elements for 2 x 8" in errors[0] and "[7, 9) of a 8-element region" in errors[1]
        assert "numel must be >= 0, got -1" in errors[3]
