"""The multi-rank harness itself: results come back, failures name their rank, hangs are bounded and located."""

import os
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


def _pid():
    return os.getpid()


def _threads():
    import torch

    return torch.get_num_threads()


def _warm():
    """Start the 2-rank pool before a timed section: spawning it is bounded apart (STARTUP_TIMEOUT) and can take
    long on a busy machine."""
    run_ranks(_sum_of_ranks, 2, 1.0, timeout=60)


def _rank_0_raises_rank_1_dies():
    if dist.get_rank() == 0:
        raise RuntimeError("rank 0 lost its peer")  # reaches the harness before rank 1's death
    time.sleep(0.5)
    os.kill(os.getpid(), 9)


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


def test_warm_pool_is_reused():
    # The same worker processes run every task (no spawn per run); speed itself is for benchmarks, not tests.
    pids = [run_ranks(_pid, 2, timeout=60) for _ in range(3)]
    assert pids[0] == pids[1] == pids[2] and len(set(pids[0])) == 2


def test_each_call_gets_the_threads_it_asks_for_from_a_warm_pool():
    # a pool started by a call with other thread counts serves the next calls with theirs
    assert run_ranks(_threads, 2, threads=3) == [3, 3]
    assert run_ranks(_threads, 2, threads=1) == [1, 1]
    default = max(1, (os.cpu_count() or 1) // 2)
    assert run_ranks(_threads, 2) == [default, default]


def test_exception_on_rank_1_reports_rank_1_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, 2, timeout=60)
    err = info.value
    assert err.rank == 1
    assert "deliberate failure on rank 1" in str(err)
    assert "_raise_on_rank_1" in err.remote_traceback
    assert "rank 1 failed" in str(err)


def test_a_dead_rank_is_reported_over_the_peer_error_that_came_first():
    # the kind of an intermittent failure at load 10: rank 1 was SIGKILLed, rank 0's gloo error arrived first
    with pytest.raises(RankFailure, match="died") as failure:
        run_ranks(_rank_0_raises_rank_1_dies, 2, timeout=60)
    assert failure.value.rank == 1


def test_skipped_collective_fails_in_bound_naming_rank_0_in_all_reduce():
    _warm()
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_1_skips_all_reduce, 2, timeout=30, pg_timeout=4)
    assert time.monotonic() - start < 30
    err = info.value
    assert err.rank == 0
    assert "all_reduce" in err.where
    assert err.finished == [1]


def test_wall_clock_bound_dumps_where_rank_0_is_stuck():
    # gloo's own timeout is set past the bound, so the harness's kill with a stack dump is what fires.
    _warm()
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank_1_skips_all_reduce_and_lingers, 2, timeout=6, pg_timeout=60)
    assert time.monotonic() - start < 6 + 30 + 10  # the bound, the longest wait for the dumps, killing
    err = info.value
    assert sorted(err.stuck) == [0, 1]
    assert "in all_reduce" in err.stuck[0]
    assert "_rank_1_skips_all_reduce_and_lingers" in err.stuck[0]
    assert "rank 0 stuck in all_reduce" in str(err)
    assert "sleep" in err.stuck[1] or "_rank_1_skips_all_reduce_and_lingers" in err.stuck[1]


def test_spinning_rank_is_killed_and_named():
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank_1_spins, 2, timeout=15)  # rank 0 returns at once; 15 s leaves it room on a busy machine
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
    _warm()
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_1_skips_all_reduce_and_lingers, 2, timeout=30, pg_timeout=3)
    assert time.monotonic() - start < 30  # gloo's 3 s, 3 s for the peers to report, then the kill
    assert info.value.rank == 0
    assert "in all_reduce" in info.value.where
    assert info.value.finished == []


def test_importing_the_test_module_does_not_count_against_the_bound(tmp_path):
    # On a busy machine importing torch-heavy test modules in the workers takes seconds; the bound is the
    # body's. The module below takes 12 s to import in a worker (not in this process); its body returns at once
    # (~0.3 s quiet); the bound is 8 s.
    import importlib.util

    path = tmp_path / "slow_import_module.py"
    path.write_text("import multiprocessing, time\nif multiprocessing.parent_process() is not None:\n"
                    "    time.sleep(12)\n\ndef body():\n    return 'done'\n")  # fmt: skip
    spec = importlib.util.spec_from_file_location("slow_import_module", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert run_ranks(mod.body, 2, timeout=8) == ["done", "done"]


class _Cycle:
    """Holds a process group the way an engine caught in a reference cycle does."""

    def __init__(self, group):
        self.group = group
        self.me = self
        self.work = None


def _leave_rank_1_all_gather_unmatched():
    cycle = _Cycle(dist.new_group([0, 1]))
    if dist.get_rank() == 1:  # rank 0 never joins it: in flight until a peer frees its copy of the group
        cycle.work = dist.all_gather_into_tensor(torch.empty(2), torch.ones(1), group=cycle.group, async_op=True)
    return len(os.listdir("/proc/self/task"))


def _live_threads():
    return len(os.listdir("/proc/self/task"))


def test_a_group_left_with_a_collective_in_flight_is_freed_when_its_task_ends():
    # A test whose ranks raised between issuing a collective and waiting for it leaves the group to its reference
    # cycles. Freed at a later task's garbage collection, on one rank only, its destructor would wait there for the
    # peers until the collective's timeout; the worker frees such groups as each task ends, on every rank: by the
    # next task their threads (gloo's loop and workers) are gone.
    _warm()
    before = run_ranks(_live_threads, 2, timeout=60)
    during = run_ranks(_leave_rank_1_all_gather_unmatched, 2, timeout=60)
    after = run_ranks(_live_threads, 2, timeout=60)
    assert all(d > b for d, b in zip(during, before)), (before, during)  # the group's threads existed
    assert after == before, (before, during, after)
