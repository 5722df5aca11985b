"""Shared-memory collectives (zero_comm.shm) on 2 and 3 gloo ranks against references built from every rank's data.

Small slots force many pieces (uneven tails, parts that end in different pieces) through each operation.
"""

import os

import pytest
import torch
import torch.distributed as dist

import zero_comm
from zero_comm import CommsLogger, shm
from zero_comm.testing import run_ranks


def _data(rank: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _channel_body(slot_bytes):
    group = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    ch = shm.channel(group, slot_bytes=slot_bytes)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for k in (1, 37, 1000):  # 1000 fp32 = 4000 bytes: several 256-byte pieces
        got = torch.full((world * k,), float("nan"))
        ch.all_gather(got, _data(rank, k))
        out[f"ag{k}"] = (got, torch.cat([_data(r, k) for r in range(world)]))
    for splits in ([5, 0, 300][:world], [130] * world, [0, 77, 1][:world]):
        n = sum(splits)
        total = sum(_data(r, n) for r in range(world))
        start = sum(splits[:rank])
        got = torch.full((splits[rank],), float("nan"))
        ch.reduce_scatter(got, _data(rank, n), list(splits))
        out[f"rs{splits}"] = (got, total[start : start + splits[rank]])
    for dtype in (torch.bfloat16, torch.float16):
        got = torch.empty(90, dtype=dtype)
        ch.reduce_scatter(got, _data(rank, 90 * world, dtype), [90] * world)
        want = sum(_data(r, 90 * world, dtype).float() for r in range(world))[rank * 90 : (rank + 1) * 90]
        out[f"rs{dtype}"] = (got.float(), want)
    for n, op in ((333, "sum"), (1, "sum"), (200, "max"), (150, "min")):
        t = _data(rank, n)
        stacked = torch.stack([_data(r, n) for r in range(world)])
        want = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
        ch.all_reduce(t, op)
        out[f"ar{n}{op}"] = (t, want)
    ints = torch.arange(50, dtype=torch.int64) * (rank + 1)
    ch.all_reduce(ints)
    out["ar_int"] = (ints, torch.arange(50, dtype=torch.int64) * sum(range(1, world + 1)))
    return out, ch.pieces, ch.barriers


@pytest.mark.parametrize("world", [2, 3])
def test_shm_channel_operations_match_references(world):
    results = run_ranks(_channel_body, world, 256, timeout=120)
    for out, pieces, barriers in results:
        assert pieces > 30 and barriers >= pieces  # the small slot really split the work
        for key, (got, want) in out.items():
            if "bfloat16" in key or "float16" in key:
                torch.testing.assert_close(got, want, rtol=1e-2, atol=3e-2, msg=key)
            elif "ar" in key and "sum" in key:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, msg=key)
            else:
                assert torch.equal(got, want) or torch.allclose(got, want, rtol=1e-6, atol=1e-6), key
    # Sums run in rank order on every rank: the replicas of an all-reduce agree bitwise.
    for key in results[0][0]:
        if key.startswith("ar"):
            assert all(torch.equal(r[0][key][0], results[0][0][key][0]) for r in results), key


def _requested_body():
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    k = 3 << 20  # 12 MiB of fp32 per rank: two pieces of the default 8 MiB slot
    with CommsLogger() as log:
        ag = torch.empty(world * k)
        zero_comm.all_gather_into_tensor(ag, _data(rank, k), group, async_op=True, algorithm="shm").wait()
        rs = torch.empty(k)
        zero_comm.reduce_scatter_tensor(rs, _data(rank, world * k), group, op="avg", algorithm="shm")
        ar = _data(rank, 1000)
        zero_comm.all_reduce(ar, group, op="avg", async_op=True, algorithm="shm").wait()
        un = torch.empty(k if rank == 0 else 0)
        zero_comm.reduce_scatter_uneven(un, _data(rank, k), [k] + [0] * (world - 1), group, algorithm="shm")
        zero_comm.all_gather_into_tensor(ag, _data(rank, k), group)  # "auto" keeps gloo's transport
    algorithms = [r.algorithm for r in log.records]
    wires = [(r.wire_bytes, r.logical_bytes) for r in log.records]
    total = sum(_data(r, world * k) for r in range(world))
    checks = {
        "ag": torch.equal(ag, torch.cat([_data(r, k) for r in range(world)])),
        "rs": torch.allclose(rs, total[rank * k : (rank + 1) * k] / world, rtol=1e-6, atol=1e-6),
        "ar": torch.allclose(ar, sum(_data(r, 1000) for r in range(world)) / world, rtol=1e-6, atol=1e-6),
        "un": rank != 0 or torch.allclose(un, sum(_data(r, k) for r in range(world)), rtol=1e-6, atol=1e-6),
    }
    ch = shm.channel(group)
    return algorithms, wires, checks, ch is not None and not any(os.path.exists(p) for p in ch.paths)


def test_collectives_run_through_shm_on_request_and_log_ring_bytes():
    for algorithms, wires, checks, has_channel in run_ranks(_requested_body, 2, timeout=120):
        assert has_channel  # and its files are already removed: the mappings outlive them
        assert algorithms == ["shm"] * 4 + ["broadcast"]
        assert all(checks.values()), checks
        ag, rs, ar, un, _ = wires
        assert ag[0] == ag[1] // 2 and rs[0] == rs[1] // 2 and ar[0] == ar[1] and un[0] == un[1] // 2


def _without_shm(body):
    """Run ``body`` with ZERO_COMM_SHM=0 in this process, then put the variable back (harness workers are reused)."""
    before = os.environ.get("ZERO_COMM_SHM")
    os.environ["ZERO_COMM_SHM"] = "0"
    try:
        return body()
    finally:
        if before is None:
            del os.environ["ZERO_COMM_SHM"]
        else:
            os.environ["ZERO_COMM_SHM"] = before


def _disabled_body():
    return _without_shm(_disabled)


def _disabled():
    group = dist.group.WORLD
    rank = dist.get_rank()
    with CommsLogger() as log:
        out = torch.empty(2 * (1 << 20))
        zero_comm.all_gather_into_tensor(out, _data(rank, 1 << 20), group)
    try:
        zero_comm.all_gather_into_tensor(out, _data(rank, 1 << 20), group, algorithm="shm")
        error = None
    except ValueError as exc:
        error = str(exc)
    return log.records[0].algorithm, error, torch.equal(out[: 1 << 20], _data(0, 1 << 20))


def test_no_channel_keeps_gloo_and_explicit_shm_names_why():
    for algorithm, error, same in run_ranks(_disabled_body, 2, timeout=120):
        assert algorithm == "broadcast" and same
        assert error is not None and "algorithm 'shm' needs a gloo group" in error and "ZERO_COMM_SHM=0" in error


def _one_rank_without_shm_body():
    group = dist.group.WORLD
    # Rank 1 alone cannot create its segment.
    ch = _without_shm(lambda: shm.channel(group)) if dist.get_rank() == 1 else shm.channel(group)
    out = torch.empty(2 * 1000)
    try:
        zero_comm.all_gather_into_tensor(out, _data(dist.get_rank(), 1000), group, algorithm="shm")
        error = None
    except ValueError as exc:
        error = str(exc)
    zero_comm.all_gather_into_tensor(out, _data(dist.get_rank(), 1000), group)  # the group still works
    return ch is None, error, torch.equal(out[1000:], _data(1, 1000))


def test_every_rank_agrees_when_one_cannot_map():
    for none, error, same in run_ranks(_one_rank_without_shm_body, 2, timeout=120):
        assert none and same and error is not None and "algorithm 'shm' needs" in error


def _dead_peer_body():
    group = dist.group.WORLD
    zero_comm.all_reduce(torch.ones(4), group, algorithm="shm")  # sets the channel up on both ranks
    if dist.get_rank() == 1:
        return "left"
    try:
        zero_comm.all_gather_into_tensor(torch.empty(8), torch.ones(4), group, algorithm="shm")
    except zero_comm.CollectiveError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_peer_that_never_arrives_is_a_collective_error_not_a_hang():
    got = run_ranks(_dead_peer_body, 2, timeout=120, pg_timeout=5)
    assert got[1] == "left"
    assert "all_gather_into_tensor on rank 0 (group of 2)" in got[0], got[0]


def test_segments_left_by_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"zero_comm_{int(dead.stdout)}_abc"
    live = tmp_path / f"zero_comm_{os.getpid()}_def"
    other = tmp_path / "zero_comm_notapid"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert shm.remove_stale_segments(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()
