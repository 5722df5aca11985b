"""reduce_scatter_uneven on 2 and 3 gloo ranks against a single-process reference built from every rank's data."""

import pytest
import torch
import torch.distributed as dist

from zero_comm import CommsLogger, reduce_scatter_uneven
from zero_comm.testing import run_ranks


def _data(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)


def _body(cases) -> list:
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for splits, dtype, op, async_op in cases:
        n = sum(splits)
        total = sum(_data(r, n, torch.float32) for r in range(world))  # fp32 reference of every rank's input
        start = sum(splits[:rank])
        want = total[start : start + splits[rank]] / (world if op == "avg" else 1)
        got = torch.full((splits[rank],), float("nan"), dtype=dtype)
        with CommsLogger() as log:
            handle = reduce_scatter_uneven(got, _data(rank, n, dtype), splits, group, op=op, async_op=async_op)
            handle.wait()
        rec = log.records[0]
        out.append((got.float(), want, rec.name, rec.logical_bytes, rec.wire_bytes, n * got.element_size()))
    return out


CASES = {
    2: [([3, 5], torch.float32, "sum", False), ([0, 7], torch.float32, "avg", True),
        ([6, 0], torch.bfloat16, "avg", True)],
    3: [([4, 0, 2], torch.float32, "sum", True), ([1, 1, 1], torch.float32, "avg", False)],
}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_uneven_matches_reference(world):
    for rank_out in run_ranks(_body, world, CASES[world], timeout=60):
        for (got, want, name, logical, wire, nbytes), (_, dtype, *_) in zip(rank_out, CASES[world]):
            tol = dict(rtol=1e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got, want, **tol)
            assert name == "reduce_scatter_uneven" and logical == nbytes
            assert wire == round((world - 1) / world * nbytes)  # mean over ranks: a reduce-scatter's bytes


def _bad_body():
    group = dist.group.WORLD
    errors = []
    for out_n, in_n, splits in [(2, 4, [2, 2, 0]), (2, 5, [2, 2]), (1, 4, [2, 2]), (2, 4, [-1, 5])]:
        try:
            reduce_scatter_uneven(torch.zeros(out_n), torch.zeros(in_n), splits, group)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_reduce_scatter_uneven_rejects_bad_sizes_before_sending():
    for errors in run_ranks(_bad_body, 2, timeout=60):
        assert len(errors) == 4
        assert "split_sizes" in errors[0] and "add up" in errors[1] and "split_sizes[" in errors[2]
        assert "non-negative" in errors[3]
