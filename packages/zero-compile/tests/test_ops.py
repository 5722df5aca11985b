"""The graph operations: fake kernels trace without communication, DCE keeps the side-effecting ones, and a model
whose graphs use them (aot_eager, 2 gloo ranks) gets the gradients of single-process eager PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import zero_compile
from zero_comm.testing import run_ranks
from zero_compile import CompiledZero, ops
from zero_compile.testing import LocalShards, TinyTransformer, batches


def test_side_effecting_ops_survive_dead_code_elimination():
    g = fx.Graph()
    x = g.placeholder("x")
    p = g.placeholder("p")
    g.call_function(ops.START, (1, [0], [p]))
    w = g.call_function(ops.WAIT, (1, 0, torch.float32, 18, p))
    g.call_function(ops.RELEASE, (1, 0, w, p))
    g.call_function(ops.REDUCE, (1, 0, [0], [x], [p]))
    g.output(None)
    g.eliminate_dead_code()
    kept = [n.target for n in g.nodes if n.op == "call_function"]
    assert kept == [ops.START, ops.WAIT, ops.RELEASE, ops.REDUCE]


def _fake_trace():
    torch._dynamo.reset()  # warm test workers are reused across tests: no graph of an earlier test
    model = torch.nn.Linear(5, 3)
    src = LocalShards(model, dist.group.WORLD)
    store = zero_compile.UnitStore(src, dist.group.WORLD, torch.device("cpu"))
    try:
        with FakeTensorMode():
            anchor = torch.empty(3, 5)
            full = ops.all_gather_wait(store.id, 0, torch.float32, 18, anchor)
            ops.release(store.id, 0, full, anchor)
            ops.reduce_grads(store.id, 0, [0], [torch.empty(3, 5)], [anchor])
        return tuple(full.shape), store.gathers, store.reduces
    finally:
        store.close()


def test_fake_kernels_trace_without_communication():
    # 18 elements padded to 18 at 2 ranks; under fake mode no collective is issued
    assert run_ranks(_fake_trace, 2, timeout=120) == [((18,), 0, 0)] * 2


def _grads_equal_eager(stage: int, piece_bytes: int | None = None, acc: int = 1, backend: str = "aot_eager"):
    torch._dynamo.reset()  # warm test workers are reused across tests: no graph of an earlier test
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = TinyTransformer()
    model = copy.deepcopy(ref)
    src = LocalShards(model, dist.group.WORLD, release=stage == 3)
    cz = CompiledZero(model, src, dist.group.WORLD, stage=stage, warmup_steps=0, piece_bytes=piece_bytes,
                      backend=backend)  # fmt: skip
    micro = batches(1, acc, world)[0]
    for m, data in enumerate(micro):
        cz.store.defer = stage == 1 and m < acc - 1  # ZeRO-1: reduce once, at the accumulation boundary
        loss = cz(*data[rank])
        loss.backward()
        cz.after_backward()
        (sum(ref(i, t) for i, t in data) / world).backward()
    full = src.full_grads()
    named = dict(ref.named_parameters())
    worst = 0.0
    for (u, name), g in full.items():
        owner = [n for n, (p, uu, s) in zip(named, src.params()) if uu == u]
        key = next(k for k in owner if k.endswith("." + name) or k == name)
        ref_g = named[key].grad
        worst = max(worst, float((g - ref_g).abs().max() / ref_g.abs().max().clamp_min(1e-12)))
    ops_in = {k: sum(n.get("zero3", n.get("zero1", {})).get(k, 0) for n in cz.notes) for k in ("gathers", "reduces")}
    ops_in["issued"] = cz.store.reduces
    cz.close()
    return worst, ops_in


@pytest.mark.smoke
def test_zero3_graph_ops_give_eager_gradients_on_two_ranks():
    out = run_ranks(_grads_equal_eager, 2, 3, timeout=240)
    n_units = 1 + 2 * 6 + 1  # embed, 6 modules with parameters per block, head
    for worst, counts in out:
        assert worst < 1e-5
        assert counts["reduces"] == n_units
        # forward gathers every unit; backward every unit but the embedding (its gradient needs only the ids)
        assert counts["gathers"] == 2 * n_units - 1


def test_zero1_graph_ops_give_eager_gradients_on_two_ranks():
    out = run_ranks(_grads_equal_eager, 2, 1, timeout=240)
    for worst, counts in out:
        assert worst < 1e-5
        assert counts["gathers"] == 0 and counts["reduces"] == 14


def test_zero1_reduces_in_pieces_give_eager_gradients():
    # 3 ranks (pieces that cover a rank's chunk partly, or not at all: uneven reduce-scatters with empty parts),
    # pieces of at most 512 bytes (the TinyTransformer's 128-element matrices are a piece each), accumulation 2:
    # the first micro-step is held back and joins the boundary's pieces
    for worst, counts in run_ranks(_grads_equal_eager, 3, 1, 512, 2, timeout=240):
        assert worst < 1e-5
        assert counts["gathers"] == 0
        assert counts["reduces"] > 14  # more reduce_grads nodes than buckets (14)
        assert counts["issued"] == counts["reduces"]  # the held micro-step issued nothing of its own


def test_inductor_with_its_joint_graph_passes_gives_eager_gradients():
    # the bench's backend: inductor's joint-graph passes and codegen run over graphs holding our operations
    for stage in (1, 3):
        for worst, counts in run_ranks(_grads_equal_eager, 2, stage, 512, 1, "inductor", timeout=600):
            assert worst < 1e-5, (stage, worst)
            assert counts["reduces"] > 14 if stage == 1 else counts["reduces"] == 14


def _opcheck_uneven() -> dict:
    """``torch.library.opcheck`` of every graph operation on a two-unit model whose sizes no world size divides (117
    and 98 elements), with the real collectives behind them; plus the sizes the operations hand out."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.Linear(13, 7))
    src = LocalShards(model, dist.group.WORLD, release=False)
    store = zero_compile.UnitStore(src, dist.group.WORLD, torch.device("cpu"))
    try:
        w1, b1, w2 = model[0].weight, model[0].bias, model[1].weight
        n1 = store.padded_numel(0)
        calls = {
            "all_gather_start": (ops.all_gather_start, (store.id, [0, 1], [w1, w2])),
            "all_gather_wait": (ops.all_gather_wait, (store.id, 1, torch.float32, store.padded_numel(1), w2)),
            "release": (ops.release, (store.id, 0, torch.empty(n1), w1)),
            "reduce_grads": (ops.reduce_grads, (store.id, 0, [0, 1], [torch.randn(13, 8), torch.randn(13)], [w1, b1])),
            "grad_anchor": (ops.grad_anchor, (torch.randn(13, 8), w1)),
        }  # fmt: skip
        results = {name: torch.library.opcheck(op, args) for name, (op, args) in calls.items()}
        gathered = ops.all_gather_wait(store.id, 0, torch.float32, n1, w1)
        expected = torch.cat([model[0].weight.detach().reshape(-1), model[0].bias.detach()])
        wrong_numel = wrong_shape = ""
        try:
            ops.all_gather_wait(store.id, 0, torch.float32, n1 + 1, w1)
        except ValueError as e:
            wrong_numel = str(e)
        try:
            ops.all_gather_wait(store.id, 0, torch.float32, n1, torch.empty(7, 13))
        except ValueError as e:
            wrong_shape = str(e)
        return {"results": results, "numel": (n1, store.padded_numel(1)), "gathered_ok": torch.equal(gathered[:117],
                expected), "wrong_numel": wrong_numel, "wrong_shape": wrong_shape}  # fmt: skip
    finally:
        store.close()


@pytest.mark.parametrize("world", [2, 3])
def test_every_operation_passes_opcheck_on_uneven_sizes(world):
    # opcheck runs each operation on copies of its inputs: real and fake kernels agree on sizes, strides, dtypes and
    # requires_grad, under AOTAutograd with dynamic shapes too; a copy of a parameter stands for its traced unit
    padded = {2: (118, 98), 3: (117, 99)}[world]
    for out in run_ranks(_opcheck_uneven, world, timeout=300):
        for name, res in out["results"].items():
            assert set(res.values()) == {"SUCCESS"}, (name, res)
        assert out["numel"] == padded
        assert out["gathered_ok"]
        assert f"traced for a unit of {padded[0] + 1} elements" in out["wrong_numel"]
        assert "shape (7, 13)" in out["wrong_shape"] and "not a parameter of this model" in out["wrong_shape"]
