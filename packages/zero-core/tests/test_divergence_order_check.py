"""Stage 3's once-per-step forward-order check (``DivergenceCheck.agree_order``) is asynchronous: the rank whose
forward ends first goes on into backward, and the comparison happens at ``settle()`` (before the backward's first
gather or reduction); ranks whose forwards differ still get RankDivergenceError on every rank."""

import time
from types import SimpleNamespace

import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import RankDivergenceError, ZeroConfig, ZeroRuntime
from zero_core.divergence import DivergenceCheck

LATE_S = 3.0  # how long rank 1 ends its forward after rank 0


def _issue_body(units_on_rank1):
    import torch.distributed as dist

    rank = dist.get_rank()
    check = DivergenceCheck(dist.group.WORLD, 2, rank)
    for i in range(units_on_rank1 if rank == 1 else 2):
        check.note(SimpleNamespace(index=i), 0)
    if rank == 1:
        time.sleep(LATE_S)
    t0 = time.perf_counter()
    check.agree_order()
    issued_s = time.perf_counter() - t0
    try:
        check.settle()
        outcome = "agreed"
    except RankDivergenceError as exc:
        outcome = str(exc)
    check.settle()  # nothing pending any more: returns at once
    check.close()
    return issued_s, outcome


def test_order_check_does_not_wait_for_the_slower_rank():
    (issued0, outcome0), (_, outcome1) = run_ranks(_issue_body, 2, 2, timeout=60)
    # rank 0 issued its check while rank 1 still slept: a blocking check would have taken LATE_S
    assert issued0 < LATE_S / 2, issued0
    assert outcome0 == outcome1 == "agreed"


def test_order_check_that_finds_ranks_apart_raises_on_every_rank_at_settle():
    for _, outcome in run_ranks(_issue_body, 2, 3, timeout=60):
        assert "rank 0: forward over after 2 unit gathers" in outcome, outcome
        assert "rank 1: forward over after 3 unit gathers" in outcome, outcome


def _gather_before_settle_body():
    """A per-gather check after an order check in flight: they meet in issue order, the order check first."""
    import torch.distributed as dist

    rank = dist.get_rank()
    check = DivergenceCheck(dist.group.WORLD, 2, rank)
    check.note(SimpleNamespace(index=0), 0)
    check.agree_order()
    unit = SimpleNamespace(index=5, slots=[SimpleNamespace(name="w")])
    check.agree(unit, 1)  # compares the pending order check first, then this one
    return "ok"


def test_a_gather_check_after_an_order_check_in_flight_pairs_correctly():
    assert run_ranks(_gather_before_settle_body, 2, timeout=60) == ["ok", "ok"]


def _runtime_body():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0, reduce_bucket_size=36))  # fmt: skip
    store = rt.params
    launches, before_reduce = [], store.before_reduce

    def spy():  # the reducer calls it before every reduction it launches
        launches[-1].append(store.divergence.pending is not None)
        before_reduce()

    store.before_reduce = spy
    after = []
    for step in range(3):
        launches.append([])
        rt.backward(rt.module(torch.full((2, 6), float(step + 1))).square().mean())
        after.append(store.divergence.pending is None)
        rt.step()
    rt.close()
    return launches, after


def test_the_first_reduction_settles_the_order_check():
    for launches, after in run_ranks(_runtime_body, 2, timeout=90):
        # steady steps (all units kept from forward to backward: no backward gather): the check is still in
        # flight when the first reduction starts, which settles it; the recording step's backward gathers did
        assert launches[0] == [False] * len(launches[0]) and len(launches[0]) > 1, launches
        for seen in launches[1:]:
            assert seen == [True] + [False] * (len(seen) - 1) and len(seen) > 1, launches
        assert after == [True] * 3


_COMPANIONS: list = []  # weak references to the last task's side and reduction groups, read by the next task


def _make_companions_body():
    import weakref

    import torch.distributed as dist

    from zero_core.divergence import side_group
    from zero_core.grad_reduction import reduction_group

    group = dist.new_group([0, 1])
    side, reduce = side_group(group), reduction_group(group)
    _COMPANIONS[:] = [weakref.ref(side), weakref.ref(reduce)]
    return side_group(group) is side and reduction_group(group) is reduce  # one of each per group, however many asks


def _companions_freed_body():
    return [r() is None for r in _COMPANIONS]


def test_side_and_reduction_groups_are_freed_with_their_group():
    # Kept once their group is destroyed, they would be freed at some later garbage collection of one rank, where a
    # group with an order check still in flight waits in its destructor for the peers; held weakly by their group,
    # they go when destroy_process_group() frees it (the harness destroys every group as each task ends).
    assert run_ranks(_make_companions_body, 2, timeout=60) == [True, True]
    assert run_ranks(_companions_freed_body, 2, timeout=60) == [[True, True], [True, True]]
