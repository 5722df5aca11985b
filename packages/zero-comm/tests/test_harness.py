"""The multi-rank harness itself: results come back, failures name their rank, hangs are bounded and located."""

import time

import pytest
import torch
import torch.distributed as dist

from zero_comm.testing import RankFailure, RankTimeout, run_ranks


def _sum_of_ranks(scale):
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), scale * t.item()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    return "fine"


def _rank_1_skips_all_reduce():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(3))
    return dist.get_rank()


def _rank_1_skips_all_reduce_and_lingers():
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(3))
    else:
        time.sleep(60)  # stays in the group, so rank 0 is not released by a closed connection
    return dist.get_rank()


def _rank_1_spins():
    if dist.get_rank() == 1:
        while True:
            time.sleep(0.05)
    return 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    out = run_ranks(_sum_of_ranks, world_size, 2.0, timeout=60)
    total = world_size * (world_size + 1) / 2
    assert out == [(r, world_size, 2.0 * total) for r in range(world_size)]


def test_warm_pool_is_reused_and_fast():
    run_ranks(_sum_of_ranks, 2, 1.0, timeout=60)
    start = time.monotonic()
    for _ in range(3):
        run_ranks(_sum_of_ranks, 2, 1.0, timeout=60)
    # Three warm runs cost less than one cold spawn of two torch processes (~2.5 s measured on 2 cores).
    assert time.monotonic() - start < 6.0


def test_exception_on_rank_1_reports_rank_1_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "deliberate failure on rank 1" in str(err)
    assert "_raise_on_rank_1" in err.remote_traceback
    assert "rank 1 failed" in str(err)


def test_skipped_collective_fails_in_bound_naming_rank_0_in_all_reduce():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_1_skips_all_reduce, 2, timeout=20, pg_timeout=4)
    assert time.monotonic() - start < 20
    err = info.value
    assert err.rank == 0
    assert "all_reduce" in err.where
    assert err.finished == [1]


def test_wall_clock_bound_dumps_where_rank_0_is_stuck():
    # gloo's own timeout is set past the bound, so the harness's kill with a stack dump is what fires.
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank_1_skips_all_reduce_and_lingers, 2, timeout=6, pg_timeout=60)
    assert time.monotonic() - start < 15
    err = info.value
    assert sorted(err.stuck) == [0, 1]
    assert "in all_reduce" in err.stuck[0]
    assert "_rank_1_skips_all_reduce_and_lingers" in err.stuck[0]
    assert "rank 0 stuck in all_reduce" in str(err)
    assert "sleep" in err.stuck[1] or "_rank_1_skips_all_reduce_and_lingers" in err.stuck[1]


def test_spinning_rank_is_killed_and_named():
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank_1_spins, 2, timeout=5)
    assert sorted(info.value.stuck) == [1]
    assert "_rank_1_spins" in info.value.stuck[1]
    # The pool is replaced after a timeout: the next run works.
    assert run_ranks(_sum_of_ranks, 2, 1.0, timeout=60)[0] == (0, 2, 3.0)


def test_local_function_is_refused():
    def body():
        return 1

    with pytest.raises(ValueError, match="module-level"):
        run_ranks(body, 2)


def test_gloo_timeout_of_a_stuck_collective_names_rank_0():
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_1_skips_all_reduce_and_lingers, 2, timeout=30, pg_timeout=3)
    assert time.monotonic() - start < 15
    assert info.value.rank == 0
    assert "in all_reduce" in info.value.where
    assert info.value.finished == []
