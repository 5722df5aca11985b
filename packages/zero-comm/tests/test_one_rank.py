"""A group of one: all-gather, reduce-scatter (even and uneven) are a local copy, with no backend call (gloo's
all-gather would fill a new buffer of the whole output and copy it out), in place or not, and still logged."""

import torch
import torch.distributed as dist

from zero_comm import CommsLogger, all_gather_into_tensor, reduce_scatter_tensor, reduce_scatter_uneven
from zero_comm import algorithms as alg
from zero_comm.testing import run_ranks


def _refuse(*args, **kwargs):
    raise AssertionError("a group of one called the backend")


def _body() -> bool:
    group = dist.group.WORLD
    saved = alg._ALL_GATHER, alg._REDUCE_SCATTER, dist.all_to_all_single
    alg._ALL_GATHER = alg._REDUCE_SCATTER = dist.all_to_all_single = _refuse
    try:
        x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
        with CommsLogger() as log:
            for algorithm in ("auto", "native", "broadcast", "all_to_all"):
                out = torch.full_like(x, float("nan"))
                all_gather_into_tensor(out, x, group, async_op=True, algorithm=algorithm).wait(10)
                assert torch.equal(out, x), algorithm
            for op in ("sum", "avg"):
                out = torch.full_like(x, float("nan"))
                reduce_scatter_tensor(out, x, group, op=op, async_op=True).wait(10)
                assert torch.equal(out, x), op  # the average of one value is the value
                out = torch.full_like(x, float("nan"))
                reduce_scatter_uneven(out, x, [1000], group, op=op, async_op=True).wait(10)
                assert torch.equal(out, x), op
            inplace = x.clone()  # output and input the same memory: nothing to copy, nothing changed
            all_gather_into_tensor(inplace, inplace, group)
            reduce_scatter_uneven(inplace, inplace, [1000], group, op="avg")
            assert torch.equal(inplace, x)
            empty = torch.empty(0)
            reduce_scatter_uneven(empty, empty, [0], group)
        names = [r.name for r in log.records]
        assert names.count("all_gather_into_tensor") == 5 and names.count("reduce_scatter_uneven") == 4, names
        assert all(r.wire_bytes == 0 for r in log.records)
    finally:
        alg._ALL_GATHER, alg._REDUCE_SCATTER, dist.all_to_all_single = saved
    return True


def test_one_rank_collectives_are_local_copies():
    assert run_ranks(_body, 1, timeout=60) == [True]
