"""Bit-exact resume with ZeroRuntime: N steps, save, fresh runtime, load, M steps == N+M, bitwise.

One run_ranks body per world size does every check: stages 0-3, fp32 and bf16, frozen params,
two optimizer param groups, dropout (so RNG state matters), a buffer; save right after init, save right after load,
and load into a runtime that already trained. Right after a load the optimizer state (``step`` included) and the
param-group hyper-parameters equal the saved run's. Two optimizers: torch's AdamW (``step`` per parameter) and an
Adam that keeps ``step`` in its param group (DeepSpeed's and apex's FusedAdam layout), fp32 only for the latter.
"""

import math
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


class GroupStepAdam(torch.optim.Optimizer):
    """AdamW that counts steps per param group (``group["step"]``, int, absent before the first step) as DeepSpeed's
    FusedAdam does; per parameter only ``exp_avg`` and ``exp_avg_sq`` (fp32, the parameter's shape)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t, lr = group["betas"], group["step"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                p.mul_(1 - lr * group["weight_decay"])
                st["exp_avg"].lerp_(p.grad, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2**t)).add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1**t))


OPTIMIZERS = {"torch-adamw": torch.optim.AdamW, "group-step-adam": GroupStepAdam}


def build(stage, dtype, seed, optim="torch-adamw"):
    torch.manual_seed(seed)
    model = TinyNet()
    groups = [
        {"params": [model.fc1.weight, model.fc2.weight], "lr": 1e-2},
        {"params": [model.fc1.bias, model.fc2.bias], "lr": 5e-3, "weight_decay": 0.0},
    ]
    opt = OPTIMIZERS[optim](groups, betas=(0.9, 0.95))
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


def step_counts(rt) -> list[int]:
    """Every step count the optimizer holds: per piece of master (torch AdamW) or per param group."""
    st = state(rt)
    return [int(v.item()) for k, v in st.items() if k.endswith("/step")] + [
        pg["step"] for pg in st["groups"] if "step" in pg
    ]


def _resume_body(root):
    rank = dist.get_rank()
    cases = [(o, s, d) for o in OPTIMIZERS for s in STAGES for d in (torch.float32, torch.bfloat16)]
    for optim, stage, dtype in [c for c in cases if c[0] == "torch-adamw" or c[2] == torch.float32]:
        d = f"{root}/{optim}-s{stage}-{str(dtype)[6:]}"
        what = f"{optim} stage {stage} {dtype} rank {rank}"
        control = build(stage, dtype, 1, optim)
        train(control, 5, 0)
        expected = state(control)

        run = build(stage, dtype, 1, optim)
        save_checkpoint(run, d, "init", client_state={"note": "init"})  # save right after init
        train(run, 3, 0)
        save_checkpoint(run, d, "step3", client_state={"step": 3, "t": torch.arange(3)}, extra_state={"k": 1.5})
        saved = state(run)

        fresh = build(stage, dtype, 99, optim)  # different init: everything must come from the checkpoint
        res = load_checkpoint(fresh, d)  # latest -> step3
        assert res.tag == "step3" and res.client_state["step"] == 3 and res.extra_state == {"k": 1.5}
        assert torch.equal(res.client_state["t"], torch.arange(3))
        # optimizer state (step included), hyper-parameters, masters, model and RNG: the saved run's
        assert_same(state(fresh), saved, f"{what}: right after load")
        assert step_counts(fresh) and set(step_counts(fresh)) == {3}, step_counts(fresh)
        save_checkpoint(fresh, d, "reloaded")  # save right after load
        train(fresh, 2, 3)
        assert_same(state(fresh), expected, f"{what}: resume 3+2")

        trained = build(stage, dtype, 7, optim)
        train(trained, 2, 50)  # load into a runtime that already trained (other data, optimizer state)
        load_checkpoint(trained, d, "reloaded")
        train(trained, 2, 3)
        assert_same(state(trained), expected, f"{what}: load into trained runtime")

        again = build(stage, dtype, 5, optim)
        train(again, 1, 50)  # its step count must not survive loading a checkpoint saved before any step
        assert load_checkpoint(again, d, "init").client_state == {"note": "init"}
        assert step_counts(again) == [], f"{what}: step counts {step_counts(again)} after loading init"
        train(again, 5, 0)
        assert_same(state(again), expected, f"{what}: resume from init")

        # optimizer state restored (step per param or per group), or reset when asked not to load it
        assert set(step_counts(fresh)) == {5}, step_counts(fresh)
        nostate = build(stage, dtype, 5, optim)
        train(nostate, 1, 50)
        load_checkpoint(nostate, d, "step3", load_optimizer_states=False)
        assert not any(nostate.master.state_shard(g) for g in nostate.flat_groups if g.group_index is not None)
        assert step_counts(nostate) == [], f"{what}: load_optimizer_states=False kept steps {step_counts(nostate)}"
        assert state(nostate)["groups"] == state(build(stage, dtype, 5, optim))["groups"], what  # as constructed
        at_step3 = state(fresh_at(stage, dtype, d, "step3", optim))
        assert_same(
            {k: v for k, v in state(nostate).items() if k.startswith(("model/", "master/"))},
            {k: v for k, v in at_step3.items() if k.startswith(("model/", "master/"))},
            f"{what}: load_optimizer_states=False",
        )
    return True


def fresh_at(stage, dtype, d, tag, optim):
    rt = build(stage, dtype, 3, optim)
    load_checkpoint(rt, d, tag)
    return rt


@pytest.mark.smoke
def test_resume_is_bit_exact_ws2():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_resume_body, 2, root, timeout=240) == [True, True]


def test_resume_is_bit_exact_ws1():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_resume_body, 1, root, timeout=240) == [True]
