"""One master tensor per bucket: fp32 stages 1/2 with several buckets per flat group keep the master as
this rank's chunk of each bucket's parameter buffer (no copy), so the model-state bytes stay at the ZeRO formula,
and training matches the one-bucket layout and single-process torch."""

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime

# reduce_bucket_size 150 cuts the 241 elements into [weight 0] (130) and [bias 0, weight 1, bias 1] (111)
SMALL = 150


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 13), nn.Tanh(), nn.Linear(13, 7))


def _data(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(stage: int, bucket_size: int | None):
    rank = dist.get_rank()
    model = _model()
    cfg = ZeroConfig(stage=stage) if bucket_size is None else ZeroConfig(stage=stage, reduce_bucket_size=bucket_size)
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg)
    g = rt.flat_groups[0]
    for step in range(3):
        rt.backward(rt.module(_data(rank, step)).square().mean(), is_boundary=True)
        rt.step()
    same = rt.master.master_shard(g) is rt.master.master_shard(g)
    shard = rt.master.master_shard(g).clone()
    rt.load_master_shards([s.clone() for s in rt.shards()])  # a checkpoint's round trip through the per-bucket master
    after = rt.master.master_shard(g)
    return dict(buckets=len(g.buckets), bytes=rt.model_state_bytes(), full=rt.full_parameters(), same=same,
                roundtrip=torch.equal(after, shard), shard_numel=g.shard_numel)  # fmt: skip


def _reference() -> dict:
    """Single-process torch: the same model, the mean over both ranks' batches, the same AdamW."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        x = torch.cat([_data(r, step) for r in range(2)])
        model(x).square().mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_per_bucket_master_keeps_the_formula_and_the_results():
    ref = _reference()
    for stage in (1, 2):
        one = run_ranks(_train, 2, stage, None, timeout=120)
        many = run_ranks(_train, 2, stage, SMALL, timeout=120)
        for a, b in zip(one, many):
            assert (a["buckets"], b["buckets"]) == (1, 2)
            assert b["same"] and b["roundtrip"]
            assert b["bytes"]["master"] == 0, (stage, b["bytes"])  # no copy: the chunks alias the parameter buffers
            psi = 242  # buckets padded to 130 + 112 elements
            shard = psi // 2
            grads = psi * 4 + shard * 4 if stage == 1 else shard * 4  # stage 1: + its separate gradient shard
            want = dict(params=psi * 4, grads=grads, master=0, optimizer=8 * shard)
            want["total"] = sum(want.values())
            assert b["bytes"] == want, (stage, b["bytes"], want)
            for name, value in ref.items():
                torch.testing.assert_close(b["full"][name], value, rtol=0, atol=1e-6)
                torch.testing.assert_close(b["full"][name], a["full"][name], rtol=0, atol=1e-7)
