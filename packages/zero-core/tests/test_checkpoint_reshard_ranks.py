"""Save on N ranks, load on M ranks, every pair in 1..4 and across stages: params and optimizer state exact.

One save run per N (every stage), one load run per M (every saved N and stage, loaded at that stage and others).
After the load, two more steps on the same global batches match a plain single-process PyTorch run (fp32, 1e-5 relative:
only the order of the cross-rank gradient sum differs).
"""

import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import LayoutMismatchError, load_checkpoint, save_checkpoint

STAGES = [0, 1, 2, 3]
# each saved stage loads at itself, plus 1 -> 0 (sharded -> whole) and 2 <-> 3 (per-group -> per-unit buffers)
LOAD_AT = {0: (0,), 1: (1, 0), 2: (2, 3), 3: (3, 2)}
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4: the same global batch at every world size


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(7, 13)
        self.emb.requires_grad_(False)
        self.fc1 = nn.Linear(13, 11)
        self.fc2 = nn.Linear(11, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(torch.tanh(self.emb(x)))))


def make(seed=1):
    torch.manual_seed(seed)
    model = Net()
    groups = [
        {"params": [model.fc1.weight, model.fc2.weight], "lr": 1e-2},
        {"params": [model.fc1.bias, model.fc2.bias], "lr": 5e-3, "weight_decay": 0.0},
    ]
    return model, torch.optim.AdamW(groups, betas=(0.9, 0.95))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def train(rt, first, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // world
    for step in range(first, first + steps):
        x, y = batch(step)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        rt.backward(nn.functional.mse_loss(rt.module(x), y))
        rt.step()


def runtime(stage, seed=1):
    model, opt = make(seed)
    return ZeroRuntime(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=60), PrecisionPolicy.fp32())


def full_state(rt):
    """Per parameter: full fp32 value, full exp_avg / exp_avg_sq and step (gathered with zero_core's own code)."""
    out = {k: v.clone() for k, v in rt.full_parameters().items()}
    for g in rt.flat_groups:
        if rt.master.master_shard(g) is None:
            continue
        for k, v in rt.master.state_shard(g).items():
            if v.dim() == 0:
                out.update({f"{s.name}/{k}": v.clone() for s in g.slots})
                continue
            shards = [v]
            if g.partitions > 1:
                buf = torch.empty(g.partitions * v.numel(), dtype=v.dtype)
                dist.all_gather_into_tensor(buf, v.contiguous())
                shards = list(buf.view(g.partitions, -1).unbind(0))
            flat = g.full_from_shards(shards)
            out.update({f"{s.name}/{k}": flat[s.offset : s.offset + s.numel].view(s.shape).clone() for s in g.slots})
    return out


def _save_body(root):
    world = dist.get_world_size()
    refs = {}
    for stage in STAGES:
        rt = runtime(stage)
        train(rt, 0, 3)
        save_checkpoint(rt, f"{root}/n{world}-s{stage}", "t3")
        refs[stage] = full_state(rt)
    return refs


def _load_body(root, refs):
    world, rank = dist.get_world_size(), dist.get_rank()
    finals = {}
    for n, by_stage in refs.items():
        for saved_stage, ref in by_stage.items():
            for stage in LOAD_AT[saved_stage]:
                rt = runtime(stage, seed=42)
                res = load_checkpoint(rt, f"{root}/n{n}-s{saved_stage}")
                assert (res.saved_layout.world_size, res.saved_layout.stage) == (n, saved_stage)
                assert res.resharded or n == world or 0 in (stage, saved_stage)
                got = full_state(rt)
                assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())
                for k in ref:
                    assert torch.equal(got[k], ref[k]), f"{n}->{world} stage {saved_stage}->{stage} rank {rank}: {k}"
                if stage == saved_stage:  # state is exact, so one continued run per saved stage is enough
                    train(rt, 3, 2)
                    finals[(n, saved_stage, stage)] = rt.full_parameters()
    return finals


def reference_after(steps):
    model, opt = make()
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def test_every_n_to_m_pair_and_stage_pair():
    expected = reference_after(5)
    with tempfile.TemporaryDirectory() as root:
        refs = {n: run_ranks(_save_body, n, root, timeout=120)[0] for n in range(1, 5)}
        for m in range(1, 5):
            finals = run_ranks(_load_body, m, root, refs, timeout=240)[0]
            assert len(finals) == 4 * len(STAGES)
            for key, params in finals.items():
                for name, value in expected.items():
                    torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=f"{key} -> {m}: {name}")


def _mismatch_body(root):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters())
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=1))
    with pytest.raises(LayoutMismatchError) as e:
        load_checkpoint(rt, f"{root}/n2-s2")
    msg = str(e.value)
    assert "saved:   stage 2, world size 2" in msg and "current: stage 1, world size 2" in msg, msg
    assert "parameters missing from the checkpoint: ['0.bias', '0.weight']" in msg, msg
    return True


def test_incompatible_checkpoint_is_refused_naming_both_layouts():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_save_body, 2, root, timeout=120)
        assert run_ranks(_mismatch_body, 2, root, timeout=60) == [True, True]
