"""Stage 3 with shared shards (``stage3_shared_shards``, zero_comm.window): ranks on one host read the peers' stored
shards from shared memory instead of all-gathering them. The results must be bitwise those of the all-gather path
(a gather is the same copy either way), over steps, a ``GatheredParameters`` edit, a load and close; odd sizes at 3
ranks put parameters across chunk ends."""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, PrecisionPolicy, ZeroConfig, ZeroRuntime


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(), nn.Linear(5, 3))


def _run(shared, extra):
    model = _model()
    extra = dict(extra)
    precision = PrecisionPolicy.bf16() if extra.pop("bf16", False) else None
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=4, stage3_shared_shards=shared, **extra)
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, precision=precision)
    rank = dist.get_rank()
    windows = sum(u.shared for u in rt.params.units.buffers if u.bucket is u.bucket.group.buckets[0])
    sharded = sum(b.padded_numel for g in rt.flat_groups for b in g.buckets if not b.persistent)
    losses, algorithms = [], set()
    for step in range(4):
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(10 * step + rank))
        with CommsLogger() as log:
            loss = rt.module(x).square().mean()
            kept = rt.params.live_numel() / sharded  # share of the units still gathered when forward ends
            rt.backward(loss)
            rt.step()
        losses.append(loss.item())
        gathers = [r for r in log.records if r.name == "all_gather_into_tensor" and r.dtype != "torch.int64"]
        algorithms |= {r.algorithm for r in gathers}  # the int64 ones: divergence checks
    with GatheredParameters([model[2].weight], modifier_rank=0):  # an edit by rank 0 reaches every rank's shard
        if rank == 0:
            with torch.no_grad():
                model[2].weight.mul_(0.5)
    edited = rt.module(torch.ones(2, 7)).detach()
    saved = [t.clone() for t in rt.shards()]
    rt.step()  # no gradient: nothing moves; then load what was saved after some more training
    for step in range(2):
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(99 + 10 * step + rank))
        rt.backward(rt.module(x).sum())
        rt.step()
    rt.load_master_shards(saved)
    loaded = rt.module(torch.ones(2, 7)).detach()
    full = {n: t.clone() for n, t in rt.full_parameters().items()}
    rt.close()
    closed = {n: p.detach().clone() for n, p in model.named_parameters()}
    return windows, losses, algorithms, edited, loaded, full, closed, kept


def _body(extra):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" falls back silently; here it must not fall back at all
        on = _run("auto", extra)
    off = _run(False, extra)
    return on, off


def _check(results, n_groups, kept_off):
    for (w_on, *on), (w_off, *off) in results:
        assert w_on == n_groups and w_off == 0
        losses_on, alg_on, edited_on, loaded_on, full_on, closed_on, kept_on = on
        losses_off, alg_off, edited_off, loaded_off, full_off, closed_off, kept_off_got = off
        # a unit read from a window is released after its forward (re-reading it is a copy): no second copy of
        # the mapped shards lives into backward, while the all-gather path keeps what the reuse distance allows
        assert kept_on == 0 and kept_off_got == kept_off
        assert alg_on == {"window"} and "window" not in alg_off
        assert losses_on == losses_off  # bitwise: a window read is the all-gather's copy
        assert torch.equal(edited_on, edited_off) and torch.equal(loaded_on, loaded_off)
        for name in full_off:
            assert torch.equal(full_on[name], full_off[name]) and torch.equal(closed_on[name], closed_off[name])
    # every rank holds the same full parameters
    first = results[0][0][5]
    for (_, *on), _ in results[1:]:
        assert all(torch.equal(first[n], on[4][n]) for n in first)


def test_shared_shards_equal_the_all_gather_path():
    _check(run_ranks(_body, 3, {}, timeout=180), 1, kept_off=1)


def test_shared_shards_release_after_every_use_and_bf16_storage():
    # units gathered again in backward (reuse distance 0), and bf16 storage read into fp32 compute buffers
    extra = {"stage3_max_reuse_distance": 0, "bf16": True}
    _check(run_ranks(_body, 2, extra, timeout=180), 1, kept_off=0)


def _fallback_body(setting):
    model = _model()
    cfg = ZeroConfig(stage=3, stage3_shared_shards=setting, offload_optimizer={"device": "cpu"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    said = [str(w.message) for w in caught if "stage3_shared" in str(w.message)]
    return [not u.shared for u in rt.params.units.buffers], said


def test_offload_keeps_the_all_gathers_and_true_says_why():
    for none, said in run_ranks(_fallback_body, 2, "auto", timeout=120):
        assert all(none) and said == []  # "auto": silently not
    for none, said in run_ranks(_fallback_body, 2, True, timeout=120):
        assert all(none) and len(said) == 1 and "an offload section is set" in said[0]
