"""Bit-exact resume with ZeroRuntime: N steps, save, fresh runtime, load, M steps == N+M, bitwise.

One run_ranks body per world size does every check: stages 0-3, fp32 and bf16, frozen params,
two optimizer param groups, dropout (so RNG state matters), a buffer; save right after init, save right after load,
and load into a runtime that already trained.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import load_checkpoint, save_checkpoint

STAGES = [0, 1, 2, 3]


class TinyNet(nn.Module):
    """Uneven sizes (no world size in 2..4 divides them), a frozen layer, dropout and a counting buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(7, 13)
        self.emb.requires_grad_(False)
        self.fc1 = nn.Linear(13, 11)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(11, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.fc2(self.drop(torch.tanh(self.fc1(torch.tanh(self.emb(x))))))


def build(stage, dtype, seed):
    torch.manual_seed(seed)
    model = TinyNet()
    groups = [
        {"params": [model.fc1.weight, model.fc2.weight], "lr": 1e-2},
        {"params": [model.fc1.bias, model.fc2.bias], "lr": 5e-3, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    precision = PrecisionPolicy.fp32() if dtype == torch.float32 else PrecisionPolicy.bf16()
    # small buckets so flat groups hold several buckets
    return ZeroRuntime(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=60), precision)


def train(rt, steps, first_step):
    rank = dist.get_rank()
    for step in range(first_step, first_step + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        rt.backward(nn.functional.mse_loss(rt.module(x).float(), y))
        rt.step()


def state(rt):
    """Everything that must match bitwise: model state (params in their dtype, buffers), masters, optimizer state,
    hyper-parameters, RNG."""
    out = {f"model/{k}": v.detach().clone() for k, v in rt.module.state_dict().items()}
    for g in rt.flat_groups:
        if rt.master.master_shard(g) is None:
            continue
        out[f"master/{g.index}"] = rt.master.master_shard(g).detach().clone()
        for k, v in rt.master.state_shard(g).items():
            out[f"optim/{g.index}/{k}"] = v.clone()
    out["groups"] = [{k: v for k, v in pg.items() if k != "params"} for pg in rt.optimizer.param_groups]
    out["rng"] = torch.get_rng_state()
    return out


def assert_same(a, b, what):
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a.keys() ^ b.keys())}"
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]} != {b[k]}"


def _resume_body(root):
    rank = dist.get_rank()
    for stage in STAGES:
        for dtype in (torch.float32, torch.bfloat16):
            d = f"{root}/s{stage}-{str(dtype)[6:]}"
            what = f"stage {stage} {dtype} rank {rank}"
            control = build(stage, dtype, seed=1)
            train(control, 5, 0)
            expected = state(control)

            run = build(stage, dtype, seed=1)
            save_checkpoint(run, d, "init", client_state={"note": "init"})  # save right after init
            train(run, 3, 0)
            save_checkpoint(run, d, "step3", client_state={"step": 3, "t": torch.arange(3)}, extra_state={"k": 1.5})

            fresh = build(stage, dtype, seed=99)  # different init: everything must come from the checkpoint
            res = load_checkpoint(fresh, d)  # latest -> step3
            assert res.tag == "step3" and res.client_state["step"] == 3 and res.extra_state == {"k": 1.5}
            assert torch.equal(res.client_state["t"], torch.arange(3))
            save_checkpoint(fresh, d, "reloaded")  # save right after load
            train(fresh, 2, 3)
            assert_same(state(fresh), expected, f"{what}: resume 3+2")

            trained = build(stage, dtype, seed=7)
            train(trained, 2, 50)  # load into a runtime that already trained (other data, optimizer state)
            load_checkpoint(trained, d, "reloaded")
            train(trained, 2, 3)
            assert_same(state(trained), expected, f"{what}: load into trained runtime")

            again = build(stage, dtype, seed=5)
            assert load_checkpoint(again, d, "init").client_state == {"note": "init"}
            train(again, 5, 0)
            assert_same(state(again), expected, f"{what}: resume from init")

            # optimizer state restored (step per param), or reset when asked not to load it
            steps = {k: v for k, v in state(fresh).items() if k.endswith("/step")}
            assert steps and all(v.item() == 5 for v in steps.values()), steps
            nostate = build(stage, dtype, seed=5)
            train(nostate, 1, 50)
            load_checkpoint(nostate, d, "step3", load_optimizer_states=False)
            assert not any(nostate.master.state_shard(g) for g in nostate.flat_groups if g.group_index is not None)
            assert_same(
                {k: v for k, v in state(nostate).items() if k.startswith(("model/", "master/"))},
                {
                    k: v
                    for k, v in state(fresh_at(stage, dtype, d, "step3")).items()
                    if k.startswith(("model/", "master/"))
                },
                f"{what}: load_optimizer_states=False",
            )
    return True


def fresh_at(stage, dtype, d, tag):
    rt = build(stage, dtype, seed=3)
    load_checkpoint(rt, d, tag)
    return rt


@pytest.mark.smoke
def test_resume_is_bit_exact_ws2():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_resume_body, 2, root, timeout=240) == [True, True]


def test_resume_is_bit_exact_ws1():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_resume_body, 1, root, timeout=240) == [True]
