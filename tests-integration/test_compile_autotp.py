"""``compile.passes: ["autotp"]``: AutoTP's collectives inserted in the compiled graph equal the eager AutoTP layers
and one process.

One 2-rank launch (tp=2, dp=1, gloo, inner compiler "aot_eager"), transformers' tiny Llama split by the "llama"
preset, ZeRO stage 1, AdamW, 2 steps on the same batch on both ranks: per step the loss of the compiled run equals
that of the eager AutoTP run and of the single-process run, and so do the final parameters (every rank's shards and
the replicated ones, 1e-5 relative); the engine runs the module compiled in one graph, with the collectives the
split layers would run (one ``tp_copy`` per shared input of column layers, one ``tp_reduce`` per row layer). The
same launch runs ``torch.library.opcheck`` on the three graph operations, checks their values against the eager
collectives, and the refusals that need ranks. The config's refusals are checked without ranks.
"""

from __future__ import annotations

import copy
import pathlib
import tempfile

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from zero_comm.testing import run_ranks

TP, BATCH, SEQ, STEPS, LR, EPS = 2, 2, 10, 2, 1e-3, 1e-6
_CHEAP_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _optimizer(model):
    # eps 1e-6: Adam's first step amplifies fp32 rounding of near-zero gradients by lr / eps (see the eager AutoTP
    # engine test); 1e-6 keeps that below the tolerance while every other element takes Adam's +-lr steps
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]


def _reference(model):
    """One process, AdamW clipped at 1.0 (zero's default): losses and final parameters."""
    model = copy.deepcopy(model)
    opt = _optimizer(model)
    losses = []
    for ids in _batches():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(model, compiled: bool, debug_dir: str = ""):
    """2 steps of the engine at tp=2, stage 1: losses, final parameters (full: the shards all-gathered), whether
    the forward is compiled, and the graph after the autotp pass (``debug_log``)."""
    import zero
    from zero_parallel import layout_of

    cfg = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 1},
           "tensor_parallel": {"autotp_size": TP, "preset_model": "llama"}}  # fmt: skip
    if compiled:
        cfg["compile"] = {"deepcompile": True, "passes": ["autotp"], "backend": "aot_eager", "debug_log": True,
                          "debug_dir": debug_dir}  # fmt: skip
    engine, *_ = zero.initialize(model=model, optimizer=_optimizer(model), config=cfg)
    losses = []
    for ids in _batches():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        losses.append(loss.item())
        engine.step()
    layout = layout_of(engine.module)
    params = {}
    for n, p in engine.module.named_parameters():
        if n in layout.shards:
            shards = [torch.empty_like(p) for _ in range(TP)]
            dist.all_gather(shards, p.detach().contiguous(), layout.group)
            params[n] = layout.shards[n].unshard(shards)
        else:
            params[n] = p.detach().clone()
    # what Engine.forward calls: the model compiled by torch.compile (the autotp backend), or the model itself
    compiles = isinstance(engine._forward, torch._dynamo.eval_frame.OptimizedModule)
    engine.destroy()
    from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

    left = [n for n, m in engine.module.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear) and m.collectives_in_graph]  # fmt: skip
    assert not left, f"after destroy() these layers still leave their collectives to a graph: {left}"
    dumps = sorted(pathlib.Path(debug_dir, f"rank{dist.get_rank()}").glob("*autotp*")) if compiled else []
    return losses, params, compiles, [d.read_text() for d in dumps]


def _worst(got: dict, want: dict) -> float:
    """The largest relative error ``||got - want|| / ||want||`` over the tensors of ``want``."""
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


def _ops_checked(rank: int) -> dict:
    """opcheck on the three operations, their values against the eager collectives, and a shape error."""
    from zero_compile.sp_ops import register_sp_group
    from zero_compile.tp_ops import TP_COPY, TP_GATHER, TP_REDUCE

    gid = register_sp_group(dist.group.WORLD)
    gen = torch.Generator().manual_seed(20 + rank)  # each rank its own values
    widths = [3, 2]  # uneven: rank 0 holds 3 features, rank 1 holds 2
    x = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, widths[rank], generator=gen, dtype=torch.float64, requires_grad=True)
    for op, args in ((TP_COPY, (x, gid, TP)), (TP_REDUCE, (x, gid, TP)), (TP_GATHER, (g, gid, widths))):
        torch.library.opcheck(op, args, test_utils=(*_CHEAP_CHECKS, "test_aot_dispatch_dynamic"))
    want = x.detach().clone()
    dist.all_reduce(want)
    got_reduce = torch.equal(TP_REDUCE(x.detach(), gid, TP), want)
    full = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(3))  # the same on both ranks
    part = full[..., :3] if rank == 0 else full[..., 3:]
    gathered = TP_GATHER(part.requires_grad_(), gid, widths)
    gathered.backward(torch.ones_like(gathered) * (rank + 1))
    y = x.detach().clone().requires_grad_()
    TP_COPY(y, gid, TP).backward(torch.full_like(y, rank + 1.0))
    try:
        TP_GATHER(torch.zeros(2, 4), gid, widths)
        error = "no error"
    except ValueError as e:
        error = str(e)
    return {"reduce": got_reduce, "gather": torch.equal(gathered, full),
            "gather_grad": torch.equal(part.grad, torch.full_like(part, rank + 1.0)),
            "copy_grad": torch.equal(y.grad, torch.full_like(y, 3.0)), "error": error}  # fmt: skip


class _MLP(torch.nn.Module):
    """Biased layers (the Llama has none): column ``up``, row ``down``, and a column ``head`` whose uneven output
    (3 + 2 features) is gathered."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.up, self.down, self.head = torch.nn.Linear(4, 6), torch.nn.Linear(6, 4), torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def _biased_and_gathered(rank: int) -> float:
    """The MLP split by AutoTP and compiled with the pass against the whole MLP in one process: the output, the
    input's gradient, every parameter's gradient (this rank's shard of it) and the split MLP's eager output after
    compilation; the largest relative error."""
    from zero.engine.compiled import split_layers
    from zero_compile.tp_backend import compile_tensor_parallel
    from zero_parallel import apply_autotp, layout_of
    from zero_parallel.tp_specs import LayerSpec, PartitionConfig, PartitionType

    whole, model = _MLP(), _MLP()
    specs = (LayerSpec(("up.weight",), PartitionType.COLUMN), LayerSpec(("down.weight",), PartitionType.ROW),
             LayerSpec(("head.weight",), PartitionType.COLUMN, gather_output=True))  # fmt: skip
    apply_autotp(model, dist.group.WORLD, PartitionConfig(layer_specs=specs, use_default_specs=False))
    compiled = compile_tensor_parallel(model, dist.group.WORLD, split_layers(model), inner="aot_eager")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = compiled(got_x), whole(want_x)
    (got.square().sum()).backward()
    (want.square().sum()).backward()
    layout = layout_of(model)
    eager = model(x)  # outside the compiled forward the layers still run their own collectives
    errors = [(got - want).norm() / want.norm(), (got_x.grad - want_x.grad).norm() / want_x.grad.norm(),
              (eager - want).norm() / want.norm()]  # fmt: skip
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        ref = layout.shards[name].shard(q.grad, rank) if name in layout.shards else q.grad
        errors.append((p.grad - ref).norm() / ref.norm())
    return max(e.item() for e in errors)


def _refused_without_a_linear() -> str:
    """A split weight used through ``matmul`` instead of ``linear``: the pass cannot find the layer's product."""
    from zero_compile.passes.autotp import SplitLinear
    from zero_compile.tp_backend import compile_tensor_parallel

    layer = torch.nn.Linear(4, 4)
    compiled = compile_tensor_parallel(lambda x: x @ layer.weight.T, dist.group.WORLD,
                                       {id(layer.weight): SplitLinear("proj", "row")}, inner="aot_eager")  # fmt: skip
    try:
        compiled(torch.ones(2, 4))
        return "no error"
    except Exception as e:  # Dynamo wraps the backend's PassError
        return str(e)


def _autotp_body() -> dict:
    torch._dynamo.reset()  # warm workers are reused across tests
    rank = dist.get_rank()
    base = _tiny_llama()
    ref_losses, ref_params = _reference(base)
    eager = _train(copy.deepcopy(base), compiled=False)
    with tempfile.TemporaryDirectory() as tmp:
        auto = _train(copy.deepcopy(base), compiled=True, debug_dir=tmp)
    return {
        "ref_losses": ref_losses,
        "eager_losses": eager[0],
        "auto_losses": auto[0],
        "eager_params_vs_ref": _worst(eager[1], ref_params),
        "auto_params_vs_ref": _worst(auto[1], ref_params),
        "auto_params_vs_eager": _worst(auto[1], eager[1]),
        "moved": min((p - ref_params[n]).abs().max().item() for n, p in _tiny_llama().named_parameters()),
        "compiled": auto[2],
        "eager_compiled": eager[2],
        "graphs": len(auto[3]),
        "ops_in_graph": {op: auto[3][0].count(f"zero_compile.{op}") for op in ("tp_copy", "tp_reduce", "tp_gather")}
        if auto[3]
        else None,
        "ops": _ops_checked(rank),
        "biased_and_gathered": _biased_and_gathered(rank),
        "no_linear": _refused_without_a_linear(),
    }


def test_autotp_equals_eager_autotp_and_one_process():
    for out in run_ranks(_autotp_body, TP, timeout=300):
        assert out["compiled"] and not out["eager_compiled"], out  # autotp's engine runs the compiled module
        torch.testing.assert_close(out["auto_losses"], out["ref_losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(out["auto_losses"], out["eager_losses"], rtol=1e-5, atol=0)
        assert out["eager_params_vs_ref"] <= 1e-5, out  # the eager run is itself exact
        assert out["auto_params_vs_ref"] <= 1e-5 and out["auto_params_vs_eager"] <= 1e-5, out
        assert out["moved"] > 1e-4, out
        # one graph: q/k/v share one copied input and gate/up another; o_proj and down_proj reduce
        assert out["graphs"] == 1, out
        assert out["ops_in_graph"] == {"tp_copy": 2, "tp_reduce": 2, "tp_gather": 0}, out["ops_in_graph"]
        assert out["biased_and_gathered"] <= 1e-5, out
        ops = out["ops"]
        assert ops["reduce"] and ops["gather"] and ops["gather_grad"] and ops["copy_grad"], ops
        assert "x has shape (2, 4); rank" in ops["error"] and "needs a last dim of" in ops["error"], ops
        assert "has no linear call on the split weight of ['proj']" in out["no_linear"], out["no_linear"]


@pytest.mark.parametrize(
    "compile_section, tensor_parallel, stage, error",
    [
        ({"passes": ["autotp", "z1"]}, {"autotp_size": 2}, 1, "'autotp' runs alone"),
        ({"passes": ["autotp"]}, {}, 1, "needs config key 'tensor_parallel.autotp_size' > 1"),
        ({"passes": ["autotp"]}, {"autotp_size": 2}, 2, "'zero_optimization.stage': 2 with compile.passes ['autotp']"),
        ({"passes": ["autotp"]}, {"autotp_size": 2, "tp_overlap_comm": True}, 1, "tensor_parallel.tp_overlap_comm"),
        ({"passes": ["autotp"], "offload_opt_states": True}, {"autotp_size": 2}, 1, "compile.offload_opt_states"),
    ],
)
def test_autotp_config_refusals(compile_section, tensor_parallel, stage, error):
    from zero.config import ConfigError, NotSupportedError, load_config

    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
           "tensor_parallel": tensor_parallel, "compile": {"deepcompile": True, **compile_section}}  # fmt: skip
    with pytest.raises((ConfigError, NotSupportedError), match=error.replace("[", r"\[").replace("]", r"\]")):
        load_config(raw, 2)
