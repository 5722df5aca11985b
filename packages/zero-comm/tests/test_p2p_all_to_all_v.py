"""Point-to-point send/recv and the all-to-all with variable split sizes, on 2 and 4 gloo ranks, against references
built on every rank from every rank's inputs: a ring exchange, a pipeline's forward sends and backward recvs,
batched ops of mixed dtypes, a peer named by its rank in a subgroup, an expert-parallel dispatch with uneven and
empty splits; and the errors a runtime relies on (a recv whose peer never sends, an all-to-all-v a rank never
joins, split sizes that do not add up)."""

import functools
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from zero_comm import (
    CollectiveTimeout,
    CommsLogger,
    P2POp,
    P2PTimeout,
    all_to_all_v,
    batch_send_recv,
    exchange_split_sizes,
    recv,
    send,
)
from zero_comm.testing import run_ranks

STUCK_S = 1.0  # the timeout a stuck op is waited with


def _ring(rank: int, world: int) -> dict:
    """Each rank sends float and int64 tensors and an empty one to its neighbours in one batch."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    a = torch.arange(6.0).reshape(2, 3) + 10 * rank
    c = torch.tensor([rank, rank * rank, -rank], dtype=torch.int64)
    b, d, e = torch.full((2, 3), float("nan")), torch.zeros(3, dtype=torch.int64), torch.empty(0)
    ops = [P2POp("send", a, nxt), P2POp("recv", b, prv), P2POp("send", c, prv, tag=1), P2POp("recv", d, nxt, tag=1),
           P2POp("send", torch.empty(0), nxt, tag=2), P2POp("recv", e, prv, tag=2)]  # fmt: skip
    with CommsLogger() as log:
        batch_send_recv(ops, async_op=True).wait(timeout=60)
    want_b = torch.arange(6.0).reshape(2, 3) + 10 * prv
    want_d = torch.tensor([nxt, nxt * nxt, -nxt], dtype=torch.int64)
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    for op in ops:
        side = sent if op.op == "send" else received
        side[op.peer] = side.get(op.peer, 0) + op.tensor.numel() * op.tensor.element_size()
    totals = log.peer_totals()
    return {
        "values": torch.equal(b, want_b) and torch.equal(d, want_d) and e.numel() == 0,
        "bytes": all(
            totals[p]["sent_bytes"] == sent.get(p, 0) and totals[p]["received_bytes"] == received.get(p, 0)
            for p in set(sent) | set(received)
        ),  # fmt: skip
        "records": sorted(r.name for r in log.records) == sorted(op.op for op in ops),
    }


def _stage(s: int, x: torch.Tensor) -> torch.Tensor:
    return x * (s + 2) + s


def _pipeline(rank: int, world: int) -> bool:
    """Stage s receives its activation from s-1 and sends its output to s+1; gradients travel back the same way."""
    x0 = torch.linspace(-1.0, 1.0, 8).reshape(2, 4)
    acts = [x0]
    for s in range(world):
        acts.append(_stage(s, acts[-1]))
    grads = [torch.ones_like(x0)]  # gradient of the sum of the last stage's output, then back through each stage
    for s in reversed(range(world)):
        grads.append(grads[-1] * (s + 2))
    grads = grads[::-1]  # grads[s]: the gradient arriving at stage s's input
    x = x0.clone() if rank == 0 else torch.empty(2, 4)
    if rank > 0:
        recv(x, rank - 1)
    y = _stage(rank, x)
    if rank < world - 1:
        send(y, rank + 1)
        g = torch.empty(2, 4)
        recv(g, rank + 1)
    else:
        g = torch.ones_like(y)
    gx = g * (rank + 2)
    if rank > 0:
        send(gx, rank - 1)
    return torch.equal(x, acts[rank]) and torch.equal(y, acts[rank + 1]) and torch.equal(gx, grads[rank])


def _subgroup(rank: int) -> tuple | None:
    """Global ranks 1 and 3 form a group; its rank 1 is global rank 3."""
    group = dist.new_group([1, 3])
    if rank not in (1, 3):
        return None
    t = torch.full((5,), float(rank)) if rank == 1 else torch.zeros(5)
    with CommsLogger() as log:
        if rank == 1:
            send(t, 1, group)
        else:
            recv(t, 0, group)
    return t.tolist(), log.records[0].peer


def _dispatch_splits(world: int) -> list[list[int]]:
    """rows[i][j]: rows rank i sends rank j. Rank 1 receives nothing; the last rank sends nothing."""
    g = torch.Generator().manual_seed(world)
    rows = torch.randint(0, 4, (world, world), generator=g)
    rows[:, 1] = 0
    rows[world - 1, :] = 0
    return rows.tolist()


def _rows(i: int, j: int, n: int, dtype) -> torch.Tensor:
    """The n rows rank i sends rank j, each naming its sender, receiver and index."""
    k = torch.arange(n).reshape(n, 1)
    return (1000 * i + 100 * j + 10 * k + torch.arange(3)).to(dtype)


def _dispatch(rank: int, world: int, dtype) -> dict:
    rows = _dispatch_splits(world)
    input_splits = rows[rank]
    output_splits = exchange_split_sizes(input_splits)
    input = torch.cat([_rows(rank, j, n, dtype) for j, n in enumerate(input_splits)])
    output = torch.full((sum(output_splits), 3), -1, dtype=dtype)
    with CommsLogger() as log:
        all_to_all_v(output, input, output_splits, input_splits, async_op=True).wait(timeout=60)
    want = torch.cat([_rows(i, rank, rows[i][rank], dtype) for i in range(world)])
    row_bytes = 3 * output.element_size()
    return {
        "splits": output_splits == [rows[i][rank] for i in range(world)],
        "values": torch.equal(output, want),
        "wire": log.records[0].wire_bytes == (sum(input_splits) - input_splits[rank]) * row_bytes,
    }


def _stuck_recv(rank: int, pair: list[int]) -> str | None:
    """The second rank of ``pair`` posts a recv its peer never sends; the peer waits until it has timed out."""
    group = dist.new_group(pair)
    store = dist.distributed_c10d._get_default_store()
    if rank == pair[0]:
        store.wait(["zero_comm_test/recv_timed_out"])
        return None
    if rank != pair[1]:
        return None
    handle = recv(torch.zeros(3, dtype=torch.bfloat16), 0, group, tag=7, async_op=True)
    start = time.monotonic()
    try:
        handle.wait(timeout=STUCK_S)
        return "no timeout"
    except P2PTimeout as exc:
        took = time.monotonic() - start
        assert isinstance(exc, TimeoutError) and exc.peer == 0 and exc.peer_global_rank == pair[0], exc
        again = pickle.loads(pickle.dumps(exc))  # how a harness or a process pool carries it
        assert type(again) is P2PTimeout and str(again) == str(exc), again
        return f"{took:.1f}s: {exc}"
    finally:
        store.set("zero_comm_test/recv_timed_out", "1")


def _stuck_all_to_all_v(rank: int) -> str | None:
    """Global ranks 0 and 1 form a group; rank 1 never joins the all-to-all-v."""
    group = dist.new_group([0, 1])
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait(["zero_comm_test/a2av_timed_out"])
    if rank != 0:
        return None
    handle = all_to_all_v(torch.empty(1, 3), torch.ones(3, 3), [1, 0], [1, 2], group, async_op=True)
    try:
        handle.wait(timeout=STUCK_S)
        return "no timeout"
    except CollectiveTimeout as exc:
        return str(exc)
    finally:
        store.set("zero_comm_test/a2av_timed_out", "1")


def _bad_input(rank: int, world: int) -> dict:
    errors = {}
    try:
        send(torch.ones(2), rank)
    except ValueError as exc:
        errors["self"] = str(exc)
    try:
        batch_send_recv([P2POp("recv", torch.ones(2), (rank + 1) % world), P2POp("send", torch.ones(2), world)])
    except ValueError as exc:
        errors["range"] = str(exc)
    try:
        all_to_all_v(torch.empty(world, 2), torch.empty(3, 2), [1] * world, [1] * world)
    except ValueError as exc:
        errors["splits"] = str(exc)
    own = [0] * world
    try:
        all_to_all_v(torch.empty(1, 2), torch.empty(0, 2), [1 if r == rank else 0 for r in range(world)], own)
    except ValueError as exc:
        errors["own"] = str(exc)
    return errors


def _body() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"ring": _ring(rank, world), "pipeline": _pipeline(rank, world)}
    out["dispatch"] = {str(dt): _dispatch(rank, world, dt) for dt in (torch.float32, torch.int64)}
    if world == 4:
        out["subgroup"] = _subgroup(rank)
        out["stuck_all_to_all_v"] = _stuck_all_to_all_v(rank)
    out["stuck_recv"] = _stuck_recv(rank, [world - 2, world - 1])  # last: a timed-out pair stays closed
    out["bad"] = _bad_input(rank, world)
    return out


@functools.cache
def _results(world: int) -> list[dict]:
    return run_ranks(_body, world, timeout=120)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_exchange_in_one_batch_delivers_every_tensor_and_logs_bytes_per_peer(world):
    for rank, res in enumerate(_results(world)):
        assert res["ring"] == {"values": True, "bytes": True, "records": True}, (rank, res["ring"])


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_sends_activations_forward_and_gradients_backward(world):
    assert [res["pipeline"] for res in _results(world)] == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_expert_dispatch_with_uneven_and_empty_splits_equals_the_reference(world):
    for rank, res in enumerate(_results(world)):
        for dtype, got in res["dispatch"].items():
            assert got == {"splits": True, "values": True, "wire": True}, (rank, dtype, got)


def test_peer_is_a_rank_of_the_group_and_the_log_names_its_global_rank():
    res = _results(4)
    assert res[1]["subgroup"] == ([1.0] * 5, 3)
    assert res[3]["subgroup"] == ([1.0] * 5, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_a_recv_whose_peer_never_sends_times_out_naming_the_peer(world):
    stuck = _results(world)[world - 1]["stuck_recv"]
    took, message = stuck.split("s: ", 1)
    assert float(took) < STUCK_S + 5, stuck
    assert f"recv from group rank 0 (global rank {world - 2}, tag 7) on rank {world - 1}" in message, message
    assert "shape (3,)" in message and "torch.bfloat16" in message, message


def test_an_all_to_all_v_a_rank_never_joins_times_out_naming_the_group_and_splits():
    message = _results(4)[0]["stuck_all_to_all_v"]
    assert message.startswith("all_to_all_v on rank 0 (group of 2)"), message
    assert "output_split_sizes [1, 0]" in message and "input_split_sizes [1, 2]" in message, message
    assert "among global ranks [0, 1]" in message, message


@pytest.mark.parametrize("world", [2, 4])
def test_bad_peer_and_split_sizes_are_refused_before_sending(world):
    for rank, res in enumerate(_results(world)):
        bad = res["bad"]
        allowed = f"must be a rank of the group other than this one (0..{world - 1}, not {rank})"
        assert f"to send: dst {allowed}, got {rank}" in bad["self"], bad
        assert f"to batch_send_recv: ops[1].peer {allowed}, got {world}" in bad["range"], bad
        assert f"input_split_sizes {[1] * world} add up to {world} rows but input has dim-0 size 3" in bad["splits"]
        assert f"output_split_sizes[{rank}] = 1 must equal input_split_sizes[{rank}] = 0" in res["bad"]["own"]
