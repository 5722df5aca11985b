"""``CommHandle.ready()``: a non-blocking poll of whether an async collective has completed on this rank (what the
core uses to give a reduction's buffers back before the end of backward)."""

import time

import torch

from zero_comm import all_gather_into_tensor, reduce_scatter_tensor
from zero_comm.testing import run_ranks

LATE_S = 1.5  # how long rank 1 waits before joining the collective


def _body(algorithm):
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.group.WORLD
    if rank == 1:
        time.sleep(LATE_S)
    send = torch.full((4,), float(rank + 1))
    out = torch.empty(8)
    if algorithm == "reduce_scatter":
        handle = reduce_scatter_tensor(out[:2], torch.arange(4.0) + rank, group, async_op=True)
    else:
        handle = all_gather_into_tensor(out, send, group, async_op=True, algorithm=algorithm)
    early = handle.ready()  # rank 0: rank 1 has not joined yet, so this cannot have completed
    deadline = time.monotonic() + 60
    while not handle.ready():  # polling never blocks; completion is seen once rank 1 joins
        if time.monotonic() > deadline:
            raise AssertionError("collective never became ready")
        time.sleep(0.01)
    handle.wait()
    after = handle.ready()
    return rank, early, after, out.tolist()


def test_ready_polls_without_blocking_and_turns_true_on_completion():
    for algorithm in ("native", "broadcast", "all_to_all", "reduce_scatter"):
        for rank, early, after, out in run_ranks(_body, 2, algorithm, timeout=90):
            if rank == 0:
                assert early is False, algorithm
            assert after is True
            if algorithm == "reduce_scatter":  # rank r gets the sum of chunk r: (0+1, 1+2) or (2+3, 3+4)
                assert out[:2] == ([1.0, 3.0] if rank == 0 else [5.0, 7.0]), out
            else:
                assert out == [1.0] * 4 + [2.0] * 4, (algorithm, out)


def _one_rank_body():
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    out = torch.empty(3)
    handle = all_gather_into_tensor(out, torch.ones(3), groups[dist.get_rank()], async_op=True)
    return handle.ready()


def test_a_group_of_one_is_ready_at_once():
    assert run_ranks(_one_rank_body, 2, timeout=60) == [True, True]
