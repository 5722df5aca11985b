"""Collective wrappers on 2, 3 and 4 gloo ranks against single-process references built from every rank's data."""

import time

import pytest
import torch
import torch.distributed as dist

from zero_comm import (
    CollectiveError,
    CollectiveTimeout,
    CommsLogger,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    broadcast,
    reduce_scatter_tensor,
)
from zero_comm.testing import run_ranks

DTYPES = (torch.float32, torch.bfloat16, torch.int8)


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-5, 6, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _all_checks() -> int:
    """Every collective, sync and async, every dtype, against the reference; returns the number of checks."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = 0
    for dtype in DTYPES:
        for async_op in (False, True):
            k = 5  # odd so nothing lines up by accident
            inputs = [_data(r, k, dtype, 1) for r in range(world)]
            out = torch.empty(world * k, dtype=dtype)
            h = all_gather_into_tensor(out, inputs[rank].clone(), group, async_op=async_op)
            h.wait(timeout=10)
            h.wait()  # a completed handle's wait is a no-op
            assert torch.equal(out, torch.cat(inputs)), ("all_gather", dtype)

            full = [_data(r, world * k, dtype, 2) for r in range(world)]
            ref_sum = torch.stack([f.to(torch.float64) for f in full]).sum(0)
            ops = ("sum", "avg") if dtype.is_floating_point else ("sum",)
            for op in ops:
                out = torch.empty(k, dtype=dtype)
                reduce_scatter_tensor(out, full[rank].clone(), group, op=op, async_op=async_op).wait(10)
                ref = ref_sum[rank * k : (rank + 1) * k]
                ref = (ref / world if op == "avg" else ref).to(dtype)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=f"reduce_scatter {op} {dtype}")

            stack = torch.stack([f.to(torch.float64) for f in full])
            refs = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0).values, "min": stack.min(0).values}
            for op in ("sum", "avg", "max", "min") if dtype.is_floating_point else ("sum", "max", "min"):
                t = full[rank].clone()
                all_reduce(t, group, op=op, async_op=async_op).wait(10)
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
                torch.testing.assert_close(t, refs[op].to(dtype), rtol=tol, atol=tol)

            out = torch.empty(world * k, dtype=dtype)
            all_to_all_single(out, full[rank].clone(), group, async_op=async_op).wait(10)
            ref = torch.cat([full[r][rank * k : (rank + 1) * k] for r in range(world)])
            assert torch.equal(out, ref), ("all_to_all", dtype)

            src = world - 1
            t = full[rank].clone()
            broadcast(t, src, group, async_op=async_op).wait(10)
            assert torch.equal(t, full[src]), ("broadcast", dtype)
            checks += 5
    return checks


def _body_all(_unused=None) -> dict:
    n = _all_checks()
    group = dist.group.WORLD
    world = dist.get_world_size()
    with CommsLogger() as log:
        x = torch.ones(8 * world, dtype=torch.bfloat16)
        out = torch.empty(8 * world * world, dtype=torch.bfloat16)
        all_gather_into_tensor(out, x, group)
        rs = torch.empty(8, dtype=torch.bfloat16)
        reduce_scatter_tensor(rs, x, group, async_op=True).wait()
        all_reduce(x, group)
    outside = torch.ones(3)
    all_reduce(outside, group)  # not recorded: the logger is closed
    return {"checks": n, "log": log.to_json(), "counts": (log.count(), log.count("all_reduce")), "table": log.summary()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_reference(world):
    results = run_ranks(_body_all, world, timeout=60)
    for res in results:
        assert res["checks"] == 5 * len(DTYPES) * 2
        assert res["counts"] == (3, 1)
        recs = {r["name"]: r for r in res["log"]["records"]}
        ag = recs["all_gather_into_tensor"]
        out_bytes = 8 * world * world * 2
        assert ag["logical_bytes"] == out_bytes
        assert ag["wire_bytes"] == round((world - 1) / world * out_bytes)
        rs = recs["reduce_scatter_tensor"]
        # "auto" on gloo: all-to-all plus a local sum, (n-1)/n of the input bytes (native: 2(n-1)/n, see
        # test_algorithms.py)
        assert rs["logical_bytes"] == 8 * world * 2
        assert rs["algorithm"] == "all_to_all" and ag["algorithm"] == "native"
        assert rs["wire_bytes"] == round((world - 1) / world * 8 * world * 2)
        assert rs["async_op"] is True
        ar = recs["all_reduce"]
        assert ar["busbw"] == pytest.approx(ar["algbw"] * 2 * (world - 1) / world)
        assert ar["latency_s"] > 0
        assert "all_reduce" in res["table"] and "| collective |" in res["table"]


def _body_bad_inputs() -> list[str]:
    """Checks that every rank rejects deterministically (same bad call on all ranks), so nobody hangs."""
    group = dist.group.WORLD
    world = dist.get_world_size()
    msgs = []
    cases = [
        lambda: all_gather_into_tensor(torch.empty(world * 4 + 1), torch.empty(4), group),
        lambda: all_gather_into_tensor(torch.empty(world * 4, dtype=torch.bfloat16), torch.empty(4), group),
        lambda: all_gather_into_tensor(torch.empty(world * 4), torch.empty(4, 2).t(), group),
        lambda: reduce_scatter_tensor(torch.empty(3), torch.empty(world * 4), group),
        lambda: reduce_scatter_tensor(torch.empty(4), torch.empty(world * 4), group, op="prod"),
        lambda: all_reduce(torch.ones(4, dtype=torch.int8), group, op="avg"),
        lambda: all_to_all_single(torch.empty(world * 2), torch.empty(world * 2 + 1), group),
        lambda: broadcast(torch.empty(3), world + 5, group),
    ]
    for case in cases:
        try:
            case()
        except ValueError as exc:
            msgs.append(str(exc))
        else:
            raise AssertionError("bad input was accepted")
    try:
        all_reduce(torch.ones(2), "world")
    except ValueError as exc:
        msgs.append(str(exc))
    # the group still works after the rejections: nothing was half-sent
    t = torch.ones(2)
    all_reduce(t, group)
    assert torch.equal(t, torch.full((2,), float(world)))
    return msgs


def test_bad_inputs_raise_value_error_naming_argument_and_shapes():
    msgs = run_ranks(_body_bad_inputs, 2, timeout=30)[0]
    assert "output has shape (9,)" in msgs[0] and "expected 8 elements" in msgs[0] and "input shape (4,)" in msgs[0]
    assert "dtype" in msgs[1] and "torch.bfloat16" in msgs[1]
    assert "input must be contiguous" in msgs[2]
    assert "input has shape (8,)" in msgs[3] and "expected 6 elements" in msgs[3]
    assert "op must be one of" in msgs[4] and "'prod'" in msgs[4]
    assert "avg" in msgs[5] and "torch.int8" in msgs[5]
    assert "output has shape (4,)" in msgs[6]
    assert "src" in msgs[7] and "7" in msgs[7]
    assert "group must be" in msgs[8]
    assert all(m.startswith("rank 0 rejected") for m in msgs[:8])


def _body_one_rank_rejects(bad_rank: int, linger: float) -> tuple[str, str, float]:
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    k = 4 if rank != bad_rank else 3
    start = time.monotonic()
    try:
        all_gather_into_tensor(torch.empty(world * 4), torch.empty(k), group)
    except (ValueError, CollectiveError) as exc:
        if rank == bad_rank:
            time.sleep(linger)  # a rejecting rank that stays alive: the peers must reach their own timeout
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "none", "", time.monotonic() - start


@pytest.mark.parametrize("linger", [0.0, 3.5])
def test_size_mismatch_on_one_rank_ends_every_rank_naming_it(linger):
    # linger 0: the rejecting rank leaves at once and the peers see the connection close;
    # linger 3.5: it stays alive, so the peers end at gloo's 2 s timeout. Either way every rank names rank 1.
    start = time.monotonic()
    results = run_ranks(_body_one_rank_rejects, 3, 1, linger, timeout=30, pg_timeout=2)
    assert time.monotonic() - start < 20
    kinds = [r[0] for r in results]
    assert kinds[1] == "ValueError"
    assert "rank 1 rejected its input to all_gather_into_tensor" in results[1][1]
    assert "output has shape (12,)" in results[1][1] and "expected 9 elements" in results[1][1]
    for r in (0, 2):
        assert kinds[r] == ("CollectiveTimeout" if linger else "CollectiveError"), results[r]
        assert "rank 1 rejected its input to all_gather_into_tensor" in results[r][1], results[r][1]
        assert f"on rank {r} (group of 3)" in results[r][1]
        assert results[r][2] < 10


def _body_wait_timeout() -> str:
    group = dist.group.WORLD
    if dist.get_rank() == 0:
        h = all_reduce(torch.ones(3), group, async_op=True)
        try:
            h.wait(timeout=0.5)
        except CollectiveTimeout as exc:
            return str(exc)
        return "completed"
    time.sleep(2.5)  # rank 1 joins late: rank 0's wait(0.5) must time out first
    return "late"


def test_wait_timeout_raises_collective_timeout():
    msg = run_ranks(_body_wait_timeout, 2, timeout=30, pg_timeout=2)[0]
    assert msg.startswith("all_reduce on rank 0 (group of 2) with tensor shape (3,)"), msg


def _async_op_outlives_logger_window() -> list:
    group = dist.group.WORLD
    out = torch.empty(2 * dist.get_world_size())
    with CommsLogger() as inside:
        handle = all_gather_into_tensor(out, torch.ones(2), group, async_op=True)
    with CommsLogger() as later:  # active when the op completes, but it did not issue it
        handle.wait()
    before = CommsLogger()
    handle2 = all_gather_into_tensor(out, torch.ones(2), group, async_op=True)  # issued with no logger active
    with before:
        handle2.wait()
    return [len(inside.records), len(later.records), len(before.records), inside.records[0].name]


def test_async_record_belongs_to_the_logger_active_at_issue():
    for out in run_ranks(_async_op_outlives_logger_window, 2, timeout=60):
        assert out == [1, 0, 0, "all_gather_into_tensor"]


def _body_group_none_and_reduce_ops() -> dict:
    from torch.distributed import ReduceOp

    from zero_comm import all_gather_coalesced, reduce_scatter_coalesced, reduce_scatter_uneven

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    full = torch.empty(world * 2)
    all_gather_into_tensor(full, torch.full((2,), float(rank)))  # group None: the default group
    out["gather"] = full.tolist()
    chunk = torch.empty(2)
    reduce_scatter_tensor(chunk, torch.arange(world * 2.0), op=ReduceOp.AVG)
    out["scatter_avg"] = chunk.tolist()
    uneven = torch.empty(1 + rank)
    reduce_scatter_uneven(uneven, torch.ones(1 + world), [1 + r for r in range(world)], op=ReduceOp.SUM)
    out["uneven"] = uneven.tolist()
    for name, op in (("sum", ReduceOp.SUM), ("avg", ReduceOp(ReduceOp.AVG)), ("max", ReduceOp.MAX),
                     ("min", ReduceOp.MIN), ("product", ReduceOp.PRODUCT)):  # fmt: skip
        t = torch.tensor([rank + 2.0])
        all_reduce(t, op=op)
        out[name] = t.item()
    b = torch.full((3,), float(rank))
    broadcast(b, 0)
    out["broadcast"] = b.tolist()
    a2a = torch.empty(world)
    all_to_all_single(a2a, torch.full((world,), float(rank)))
    out["a2a"] = a2a.tolist()
    gathered = [torch.empty(world), torch.empty(2 * world)]
    all_gather_coalesced(gathered, [torch.full((1,), float(rank)), torch.full((2,), float(rank))])
    out["coalesced"] = gathered[1].tolist()
    shards = [torch.empty(1), torch.empty(3)]
    reduce_scatter_coalesced(shards, [torch.ones(world), torch.ones(3 * world)], op=ReduceOp.SUM)
    out["rs_coalesced"] = shards[1].tolist()
    refused = []
    for bad in (ReduceOp.BAND, ReduceOp.BXOR, "prod"):
        try:
            all_reduce(torch.ones(2, dtype=torch.int32), op=bad)
        except ValueError as exc:
            refused.append(str(exc))
    out["refused"] = refused
    t = torch.ones(2)  # the group still works after the refusals
    all_reduce(t)
    out["after"] = t.tolist()
    return out


def test_group_none_is_the_world_and_torch_reduce_ops_are_accepted():
    for rank, out in enumerate(run_ranks(_body_group_none_and_reduce_ops, 2, timeout=60)):
        assert out["gather"] == [0.0, 0.0, 1.0, 1.0]
        assert out["scatter_avg"] == [2.0 * rank, 2.0 * rank + 1]  # (x + x) / 2 of rank's chunk
        assert out["uneven"] == [2.0] * (1 + rank)
        assert (out["sum"], out["avg"], out["max"], out["min"], out["product"]) == (5.0, 2.5, 3.0, 2.0, 6.0)
        assert out["broadcast"] == [0.0] * 3 and out["a2a"] == [0.0, 1.0]
        assert out["coalesced"] == [0.0, 0.0, 1.0, 1.0] and out["rs_coalesced"] == [2.0] * 3
        assert "ReduceOp.BAND" in out["refused"][0] and "ReduceOp.BXOR" in out["refused"][1]
        assert "'prod'" in out["refused"][2]
        for msg in out["refused"]:
            assert "op must be one of ('sum', 'avg', 'max', 'min', 'product')" in msg and "ReduceOp.PRODUCT" in msg
        assert out["after"] == [2.0, 2.0]
