"""gloo all-gather / reduce-scatter algorithms on 2, 3 and 4 ranks against the native call and exact references."""

import pytest
import torch
import torch.distributed as dist

from zero_comm import CommsLogger, all_gather_into_tensor, reduce_scatter_tensor
from zero_comm.algorithms import GLOO_BROADCAST_MIN_BYTES
from zero_comm.testing import run_ranks

AG = ("native", "broadcast", "all_to_all", "shm")
RS = ("native", "all_to_all", "shm")


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _body() -> dict:
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    k = 7  # odd: uneven buffers are padded by callers to w * k
    for dtype in (torch.float32, torch.bfloat16):
        shards = [_data(r, k, dtype, 1) for r in range(world)]
        full = [_data(r, world * k, dtype, 2) for r in range(world)]
        exact = torch.stack([f.double() for f in full]).sum(0)[rank * k : (rank + 1) * k]
        for async_op in (False, True):
            for alg in AG:  # every all-gather algorithm equals the reference bitwise
                out = torch.full((world * k,), float("nan"), dtype=dtype)
                inp = shards[rank].clone()
                all_gather_into_tensor(out, inp, group, async_op=async_op, algorithm=alg).wait(10)
                assert torch.equal(out, torch.cat(shards)), (alg, dtype, async_op)
                assert torch.equal(inp, shards[rank]), ("input modified", alg)
            native = {}
            for alg in RS:
                for op in ("sum", "avg"):
                    out = torch.empty(k, dtype=dtype)
                    inp = full[rank].clone()
                    h = reduce_scatter_tensor(out, inp, group, op=op, async_op=async_op, algorithm=alg)
                    h.wait(10)
                    assert torch.equal(inp, full[rank]), ("input modified", alg)
                    ref = exact / world if op == "avg" else exact
                    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
                    torch.testing.assert_close(out, ref.to(dtype), rtol=tol, atol=tol, msg=f"{alg} {op} {dtype}")
                    if alg == "native":
                        native[op] = out
                    elif world == 2:  # a + b in one rounding either way: bitwise equal to gloo's sum
                        assert torch.equal(out, native[op]), (alg, op, dtype)
                    else:  # a different (fixed) summation order: within rounding of gloo's result
                        torch.testing.assert_close(out, native[op], rtol=tol, atol=tol)
    # Deterministic: the same inputs twice give bitwise the same "all_to_all" reduce-scatter output.
    a, b = torch.empty(k), torch.empty(k)
    reduce_scatter_tensor(a, full[rank].float(), group, algorithm="all_to_all")
    reduce_scatter_tensor(b, full[rank].float(), group, algorithm="all_to_all")
    assert torch.equal(a, b)
    with CommsLogger() as log:
        for alg in AG:
            all_gather_into_tensor(torch.empty(world * k), torch.ones(k), group, algorithm=alg)
        for alg in RS:
            reduce_scatter_tensor(torch.empty(k), torch.ones(world * k), group, algorithm=alg)
        # "auto": native all-gather below the threshold, broadcasts at it; all-to-all reduce-scatter
        small = torch.ones(k)
        all_gather_into_tensor(torch.empty(world * k), small, group)
        big_k = GLOO_BROADCAST_MIN_BYTES // 4 // world + 1
        big = torch.full((big_k,), float(rank))
        big_out = torch.empty(world * big_k)
        all_gather_into_tensor(big_out, big, group, async_op=True).wait(30)
        reduce_scatter_tensor(torch.empty(k), torch.ones(world * k), group)
    assert torch.equal(big_out, torch.arange(world, dtype=torch.float32).repeat_interleave(big_k))
    try:
        all_gather_into_tensor(torch.empty(world * k), torch.ones(k), group, algorithm="ring")
    except ValueError as exc:
        msg = str(exc)
    else:
        raise AssertionError("unknown algorithm accepted")
    return {"records": [(r.name, r.algorithm, r.logical_bytes, r.wire_bytes) for r in log.records], "msg": msg}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_algorithms_match_native_and_account_bytes(world):
    k = 7
    full_bytes = world * k * 4
    ring = round((world - 1) / world * full_bytes)
    big = world * (GLOO_BROADCAST_MIN_BYTES // 4 // world + 1) * 4
    expected = [
        ("all_gather_into_tensor", "native", full_bytes, ring),
        ("all_gather_into_tensor", "broadcast", full_bytes, ring),  # binomial trees: (w-1)k per rank over w roots
        ("all_gather_into_tensor", "all_to_all", full_bytes, ring),
        ("all_gather_into_tensor", "shm", full_bytes, ring),  # peers read (w-1)/w of the output from this rank
        ("reduce_scatter_tensor", "native", full_bytes, round(2 * (world - 1) / world * full_bytes)),  # all-reduce
        ("reduce_scatter_tensor", "all_to_all", full_bytes, ring),
        ("reduce_scatter_tensor", "shm", full_bytes, ring),
        ("all_gather_into_tensor", "native", full_bytes, ring),
        ("all_gather_into_tensor", "broadcast", big, round((world - 1) / world * big)),
        ("reduce_scatter_tensor", "all_to_all", full_bytes, ring),
    ]
    for res in run_ranks(_body, world, timeout=90):
        assert res["records"] == expected
        assert "algorithm must be one of" in res["msg"] and "'ring'" in res["msg"]
