"""Optimizer offload inside ZeroRuntime equals the same run without offload (fp32: 1e-6 relative), and
SuperOffload's speculative step equals the plain offloaded step bitwise (no clip, clip, overflow), at stages 1-3,
world sizes 1-3, accumulation 1 and 4, clipping on and off, with a frozen, an unused and a tied parameter."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_offload import OffloadMaster

VOCAB, STEPS = 11, 2


class Net(nn.Module):
    """Uneven sizes; ``head`` shares ``emb``'s weight (tied); ``frozen`` has requires_grad False; ``unused`` never
    enters forward (its gradient is zero every step)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(6, 7)
        self.fc2 = nn.Linear(7, 6)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(6, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = torch.tanh(self.frozen(self.emb(x)))
        return self.head(self.fc2(torch.tanh(self.fc(h))))


def _runtime(stage, master, clip, seed=0, bf16=False):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if "bias" not in n and p.requires_grad]},
         {"params": [p for n, p in model.named_parameters() if "bias" in n and p.requires_grad], "lr": 3e-3,
          "weight_decay": 0.0}],
        lr=1e-2, weight_decay=0.1,
    )  # fmt: skip
    cfg = ZeroConfig(stage=stage, reduce_bucket_size=40, overlap_comm=True)
    prec = PrecisionPolicy.bf16() if bf16 else PrecisionPolicy.fp32()
    return ZeroRuntime(model, opt, cfg, prec, gradient_clipping=clip, master_store=master)


def _train(rt, accum, steps=STEPS, overflow_at=None, norms=None):
    """Train ``steps`` steps of ``accum`` micro-batches; returns the losses, appends each step's pre-clip global
    gradient norm to ``norms`` when given."""
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        for micro in range(accum):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randint(0, VOCAB, (4, 5), generator=g)
            loss = nn.functional.cross_entropy(rt.module(x).flatten(0, 1).float(), x.flatten()) / accum
            if step == overflow_at and micro == accum - 1:
                loss = loss * float("inf")
            rt.backward(loss, is_boundary=micro == accum - 1)
            losses.append(loss.item())
        result = rt.step()
        if norms is not None:
            norms.append(result.grad_norm)
    return losses


def _state(rt):
    out = dict(rt.full_parameters())
    for g in rt.flat_groups:
        if g.group_index is not None:
            for k, v in rt.master.state_shard(g).items():
                out[f"state/{g.index}/{k}"] = torch.as_tensor(v).clone()
    return out


def _close(a, b, what, rtol=1e-6, atol=1e-7):
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{what} {k}: {m}")


def _bitwise(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _parity_body(with_super):
    rank = dist.get_rank()
    for stage in (1, 2, 3):
        for accum in (1, 4):
            for clip in (0.0, 0.05):
                what = f"stage {stage} accum {accum} clip {clip} rank {rank}"
                ref = _runtime(stage, None, clip)
                off = _runtime(stage, OffloadMaster.builder("cpu", sub_group_size=23), clip)
                norm_ref, norm_off = [], []
                lr, lo = _train(ref, accum, norms=norm_ref), _train(off, accum, norms=norm_off)
                assert all(math.isfinite(x) for x in lo)
                # the global norm clipping reads (the unused layer's zero gradient included), on every rank
                assert all(math.isfinite(n) and n > 0 for n in norm_off), (what, norm_off)
                torch.testing.assert_close(
                    norm_off, norm_ref, rtol=1e-6, atol=0.0, msg=lambda m, w=what: f"{w} norms: {m}"
                )
                torch.testing.assert_close(lo, lr, rtol=1e-6, atol=1e-7, msg=lambda m, w=what: f"{w} losses: {m}")
                _close(_state(off), _state(ref), what)
                unused = off.full_parameters()["unused.weight"]
                torch.testing.assert_close(unused, ref.full_parameters()["unused.weight"], rtol=1e-6, atol=1e-7)
                runtimes = [ref, off]
                if with_super:  # the speculative step, bitwise against the plain offloaded step
                    sup = _runtime(stage, OffloadMaster.builder("cpu", sub_group_size=23, super_offload=True), clip)
                    assert _train(sup, accum) == lo, what
                    _bitwise(_state(sup), _state(off), what + " super_offload")
                    stats = sup.master.spec.stats
                    assert stats["speculated"] > 0 and (stats["redone"] > 0) == (clip > 0), (what, stats)
                    runtimes.append(sup)
                for rt in runtimes:
                    rt.close()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_matches_device_master(world):
    run_ranks(_parity_body, world, world == 2, timeout=300, threads=1)


def _overflow_body():
    for stage in (1, 3):
        off = _runtime(stage, OffloadMaster.builder("cpu", sub_group_size=23), 0.0)
        sup = _runtime(stage, OffloadMaster.builder("cpu", sub_group_size=23, super_offload=True), 0.0)
        before = _state(off)
        _train(off, 1, steps=4, overflow_at=1)
        _train(sup, 1, steps=4, overflow_at=1)
        assert off.skipped_steps == sup.skipped_steps == 1
        _bitwise(_state(sup), _state(off), f"stage {stage} overflow")
        assert sup.master.spec.stats["rolled_back"] > 0
        assert not all(torch.equal(before[k], v) for k, v in _state(off).items())
        off.close()
        sup.close()


def test_speculative_overflow_rolls_back_bitwise():
    run_ranks(_overflow_body, 2, timeout=180, threads=1)


def _ratio_body():
    ref = _runtime(2, None, 0.0)
    twin = _runtime(2, OffloadMaster.builder("cpu", sub_group_size=17, ratio=0.5), 0.0)
    _train(ref, 2)
    _train(twin, 2)
    assert any(not sg.on_host for sg in twin.master.store.sub_groups)
    _close(_state(twin), _state(ref), "ratio 0.5")


def test_twin_flow_ratio_matches():
    run_ranks(_ratio_body, 2, timeout=120, threads=1)


def _nvme_body(root):
    from zero_kernels.aio import AioSettings
    from zero_offload import master_store_for

    for stage in (1, 2, 3):
        ref = _runtime(stage, None, 0.05)
        section = {"stage": stage, "reduce_bucket_size": 40, "overlap_comm": True, "sub_group_size": 16,
                   "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 2,
                                         "pipeline_read": stage != 2, "pipeline_write": stage != 2}}  # fmt: skip
        cfg = ZeroConfig.model_validate(section)
        master = master_store_for(cfg, Net(), dist.get_world_size(), dist.get_rank(), AioSettings(block_size=4096))
        nvme = _runtime(stage, master, 0.05)
        store = nvme.master.store
        assert sum(map(store.region_numel, store.sub_groups)) > store.ring.numel  # swapping really happens
        r0, w0 = store.io.reads, store.io.writes
        early, receive = [], store.receive_grad

        # the step's reads started as backward began, before its first gradient came
        def spy(*args, early=early, store=store, receive=receive, **kw):
            early.append(len(store._early))
            return receive(*args, **kw)

        store.receive_grad = spy
        lr, ln = _train(ref, 2), _train(nvme, 2)
        assert early and (min(early) > 0 if stage != 2 else max(early) == 0), early  # DeepSpeed's default: off
        m = nvme.master  # sub-groups of `unused` are skipped (no gradient on any rank), so not swapped
        unused = {sg.index for sg in store.sub_groups for a, e, slot in m._owner[sg.shard]
                  if a <= sg.start < e and m._groups[sg.shard].slots[slot].name.startswith("unused")}  # fmt: skip
        n = len(store.sub_groups) - len(unused)
        assert unused and (store.io.reads - r0, store.io.writes - w0) == (2 * n, 2 * n)  # one read + write each
        torch.testing.assert_close(ln, lr, rtol=1e-6, atol=1e-7)
        _close(_state(nvme), _state(ref), f"nvme stage {stage}")
        ref.close()
        nvme.close()


@pytest.mark.smoke
def test_nvme_matches_device_master(tmp_path):
    run_ranks(_nvme_body, 2, str(tmp_path), timeout=180, threads=1)
    assert not (tmp_path / "zero_swap").exists()


def _memory_body():
    for stage in (1, 2, 3):
        ref = _runtime(stage, None, 0.0)
        off = _runtime(stage, OffloadMaster.builder("cpu", sub_group_size=23), 0.0)
        _train(ref, 1)
        _train(off, 1)
        dev, base = off.model_state_bytes(), ref.model_state_bytes()
        # on the device: parameters (storage dtype; stage 3: the shard) and the gradient shard, nothing else
        assert dev["master"] == dev["optimizer"] == 0, (stage, dev)
        assert (dev["params"], dev["grads"]) == (base["params"], base["grads"]), (stage, dev, base)
        shard = sum(g.shard_numel for g in off.flat_groups if g.group_index is not None)
        assert off.master.host_bytes() == 16 * shard  # host: fp32 master + fp32 grad + Adam's two moments
        ref.close()
        off.close()


def test_device_keeps_params_and_grads_only():
    run_ranks(_memory_body, 2, timeout=120, threads=1)


def _gathered_edit_body(root):
    """A ``GatheredParameters(modifier_rank=0)`` edit reaches the master wherever it lives (host view, a Twin-Flow
    split, NVMe swap files): the next step starts from the edited values, as without offload (DeepSpeed's
    behaviour for stage-3 parameter edits)."""
    from zero_core import GatheredParameters
    from zero_kernels.aio import AioSettings
    from zero_offload import master_store_for

    def nvme():
        section = {"stage": 3, "reduce_bucket_size": 40, "sub_group_size": 16,
                   "offload_optimizer": {"device": "nvme", "nvme_path": root, "buffer_count": 2}}  # fmt: skip
        cfg = ZeroConfig.model_validate(section)
        return master_store_for(cfg, Net(), dist.get_world_size(), dist.get_rank(), AioSettings(block_size=4096))

    masters = {
        "cpu": lambda: OffloadMaster.builder("cpu", sub_group_size=23),
        "ratio 0.5": lambda: OffloadMaster.builder("cpu", sub_group_size=17, ratio=0.5),
        "nvme": nvme,
    }
    for what, make in masters.items():
        ref, off = _runtime(3, None, 0.0), _runtime(3, make(), 0.0)
        for rt in (ref, off):
            _train(rt, 1, steps=1)
            with GatheredParameters([rt.module.fc.weight, rt.module.emb.weight], modifier_rank=0):
                if dist.get_rank() == 0:
                    rt.module.fc.weight.data.fill_(0.25)
                    rt.module.emb.weight.data[0].fill_(-1.0)
            _train(rt, 1, steps=1)
        _close(_state(off), _state(ref), f"edit under {what}")
        ref.close()
        off.close()


def test_gathered_parameters_edit_reaches_offloaded_master(tmp_path):
    run_ranks(_gathered_edit_body, 2, str(tmp_path), timeout=180, threads=1)
