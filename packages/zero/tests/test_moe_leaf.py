"""Mixture-of-experts models at ZeRO-3 with leaf modules (DeepSpeed's ``set_z3_leaf_modules`` and the config's
``zero_optimization.leaf_module``): a top-1 router sends each rank's tokens to different experts, and 2 ranks equal
one process (fp32, 1e-5 relative); without a leaf the ranks' different units are reported, never a hang."""

import pytest
import torch

import zero
from zero.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from zero_comm.testing import run_ranks
from zero_core import RankDivergenceError

STEPS = 3


class TopOneMoE(torch.nn.Module):
    """A top-1 router over four experts; a token goes to the expert its router score picks, scaled by the score's
    softmax probability (so the router trains too)."""

    def __init__(self, dim=8, experts=4):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))
        with torch.no_grad():
            self.router.weight.copy_(torch.eye(experts, dim) * 4)  # expert e: tokens whose feature e is largest

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        top, pick = probs.max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (pick == e).nonzero().flatten()
            if rows.numel():  # an expert no token picked is not called at all
                out = out.index_add(0, rows, expert(x[rows]) * top[rows, None])
        return out


class MoENet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.inp = torch.nn.Linear(8, 8)
        self.moe = TopOneMoE()
        self.out = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.inp.weight.copy_(torch.eye(8) + 0.01 * torch.randn(8, 8))

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _data(step, rank):
    """Rank r's tokens carry a large feature r: rank 0 routes to expert 0, rank 1 to expert 1 (3 never used)."""
    g = torch.Generator().manual_seed(17 * step + rank)
    x = 0.1 * torch.randn(6, 8, generator=g)
    x[:, rank] += 3.0
    x[-1, 2] += 6.0 if rank == 0 else 0.0  # one token of rank 0 goes to expert 2
    return x, torch.randn(6, 1, generator=g)


def _cfg(leaf_module=None):
    zo = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if leaf_module is not None:
        zo["leaf_module"] = leaf_module
    return {"train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": zo}  # fmt: skip


def moe_body(how):
    model = MoENet()
    if how == "call":
        found = set_z3_leaf_modules(model, [TopOneMoE])
        assert found == [model.moe] and z3_leaf_module(model.moe) and get_z3_leaf_modules(model) == [model.moe]
    config = _cfg({"classes": ["TopOneMoE"]} if how == "config" else {"names": ["moe"]} if how == "names" else None)
    engine, *_ = zero.initialize(model=model, config=config)
    assert get_z3_leaf_modules(engine.module) == [model.moe]  # the config's form marks them too
    assert z3_leaf_parameter(model.moe.experts[3].weight) and not z3_leaf_parameter(model.inp.weight)
    rank, after = torch.distributed.get_rank(), []
    for step in range(STEPS):
        x, y = _data(step, rank)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        after.append(engine.runtime.full_parameters())
    engine.destroy()
    unset_z3_leaf_modules(model, [TopOneMoE])
    return after


def _reference():
    model = MoENet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in (_data(step, 0), _data(step, 1))]
        ((losses[0] + losses[1]) / 2).backward()
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], 1.0, total)
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


@pytest.mark.parametrize("how", ["call", "config", "names"])
def test_moe_with_leaf_module_equals_one_process(how):
    ref, start = _reference(), MoENet()
    with torch.no_grad():  # the ranks' tokens pick different experts
        picks = [sorted(set(start.moe.router(start.inp(_data(0, r)[0])).argmax(-1).tolist())) for r in (0, 1)]
    assert picks == [[0, 2], [1]]
    for after in run_ranks(moe_body, 2, how, timeout=120, threads=1):
        for step, (got, want) in enumerate(zip(after, ref)):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
        assert torch.equal(after[-1]["moe.experts.3.weight"], ref[0]["moe.experts.3.weight"])  # never used


def no_leaf_body():
    engine, *_ = zero.initialize(model=MoENet(), config=_cfg({"classes": []}))
    x, y = _data(0, torch.distributed.get_rank())
    with pytest.raises(RankDivergenceError):  # the first forward checks every gather
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    return True


def test_moe_without_leaf_reports_divergence_instead_of_hanging():
    assert all(run_ranks(no_leaf_body, 2, timeout=120, threads=1))


def test_leaf_marking_by_name_and_errors():
    model = MoENet()
    assert set_z3_leaf_modules_by_name(model, ["moe", "nope"], raise_if_not_found=False) == ([model.moe], ["nope"])
    with pytest.raises(ValueError, match="no modules named"):
        set_z3_leaf_modules_by_name(model, ["nope"])
    with pytest.raises(ValueError, match="no module of the classes"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])
    with pytest.raises(TypeError, match="types or class names"):
        set_z3_leaf_modules(model, [3])


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(9)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32)  # fmt: skip
    return MixtralForCausalLM(cfg)


def _tokens(step, rank):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(23 * step + rank))


def mixtral_body():
    model = _mixtral()
    engine, *_ = zero.initialize(model=model, config=_cfg())  # the default leaf_module classes name the block
    blocks = [layer.mlp for layer in model.model.layers]
    assert get_z3_leaf_modules(model) == blocks
    rank, after = torch.distributed.get_rank(), []
    for step in range(2):
        ids = _tokens(step, rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        after.append(engine.runtime.full_parameters())
    engine.destroy()
    return after


def test_tiny_mixtral_at_zero3_equals_one_process():
    model = _mixtral()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref = []
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        losses = [model(input_ids=_tokens(step, r), labels=_tokens(step, r)).loss for r in (0, 1)]
        ((losses[0] + losses[1]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ref.append({k: v.detach().clone() for k, v in model.named_parameters()})
    for after in run_ranks(mixtral_body, 2, timeout=240, threads=1):
        for step, (got, want) in enumerate(zip(after, ref)):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
