"""Parameter offload at stage 3 (``offload_param: cpu``) equals stage 3 without offload (fp32: 1e-6 relative) at
world sizes 1-3, accumulation 1 and 4, with and without ``offload_optimizer: cpu``, with a frozen, an unused and a
tied parameter; the device keeps exactly the persistent units (plus gradients, and masters/optimizer state when the
optimizer is not offloaded); the shards reach the device ahead of their unit along the recorded order."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_offload import OffloadMaster, OffloadParamStore

VOCAB, STEPS = 11, 3


class Net(nn.Module):
    """Uneven sizes; ``head`` shares ``emb``'s weight (tied); ``frozen`` has requires_grad False; ``unused`` never
    enters forward. Biases (<= 7 elements) are persistent units, weights are gathered per module."""

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


def _master(offload_opt: bool):
    """Host-memory optimizer offload (23-element sub-groups), or None: the core's device master."""
    return OffloadMaster.builder("cpu", sub_group_size=23) if offload_opt else None


def _runtime(offload_param, offload_opt, clip=0.0):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    cfg = ZeroConfig(stage=3, reduce_bucket_size=40, overlap_comm=True, stage3_param_persistence_threshold=8)
    return ZeroRuntime(model, opt, cfg, PrecisionPolicy.fp32(), gradient_clipping=clip,
                       param_store=OffloadParamStore() if offload_param else None,
                       master_store=_master(offload_opt))  # fmt: skip


def _train(rt, accum, steps=STEPS):
    rank, losses = dist.get_rank(), []
    for step in range(steps):
        for micro in range(accum):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x = torch.randint(0, VOCAB, (4, 5), generator=g)
            loss = nn.functional.cross_entropy(rt.module(x).flatten(0, 1), x.flatten()) / accum
            rt.backward(loss, is_boundary=micro == accum - 1)
            losses.append(loss.item())
        rt.step()
    return losses


def _parity_body():
    rank = dist.get_rank()
    for accum in (1, 4):
        for offload_opt in (False, True):
            what = f"accum {accum} offload_optimizer {offload_opt} rank {rank}"
            clip = 0.05 if offload_opt else 0.0
            ref, off = _runtime(False, False, clip), _runtime(True, offload_opt, clip)
            lr, lo = _train(ref, accum), _train(off, accum)
            torch.testing.assert_close(lo, lr, rtol=1e-6, atol=1e-7, msg=lambda m, w=what: f"{w} losses: {m}")
            a, b = off.full_parameters(), ref.full_parameters()
            assert a.keys() == b.keys()
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k, w=what: f"{w} {k}: {m}")
            assert torch.equal(a["frozen.weight"], b["frozen.weight"])
            sharded = [b for g in off.flat_groups for b in g.buckets if not b.persistent]
            assert sharded and all(off.params.shard_view(g) is None for g in off.flat_groups), what
            # every gather of a sharded unit copied its chunk from host memory; after the first step, ahead of use
            assert off.params.storage.copies["to_device"] >= off.params.gathers > 0, what
            assert off.params.storage.copies["ahead"] > 0, what
            ref.close()
            off.close()
            # close() leaves plain parameters with the trained values
            assert all(p.numel() > 0 for p in off.module.parameters())


@pytest.mark.smoke
@pytest.mark.parametrize("world", [1, 2, 3])
def test_param_offload_matches_stage3(world):
    run_ranks(_parity_body, world, timeout=300, threads=1)


def _memory_body():
    for offload_opt in (False, True):
        ref, off = _runtime(False, offload_opt), _runtime(True, offload_opt)
        _train(ref, 1, steps=1)
        _train(off, 1, steps=1)
        dev, base = off.model_state_bytes(), ref.model_state_bytes()
        # on the device: the persistent units' full buffers only (non-persistent units are released after the step)
        persistent = sum(b.padded_numel * 4 for g in off.flat_groups for b in g.buckets if b.persistent)
        shards = sum(g.shard_numel * 4 for g in off.flat_groups)
        assert dev["params"] == persistent, (dev, persistent)
        assert base["params"] == persistent + shards, (base, persistent, shards)
        # gradients and optimizer state are where they would be without parameter offload; the fp32 master shard
        # stays on the device unless the optimizer is offloaded (without offload it *is* the stored shard)
        assert (dev["grads"], dev["optimizer"]) == (base["grads"], base["optimizer"]), (dev, base)
        trainable = sum(g.shard_numel for g in off.flat_groups if g.group_index is not None)
        assert (dev["master"], base["master"]) == ((0, 0) if offload_opt else (4 * trainable, 0)), (dev, base)
        assert off.params.storage.host_bytes() == shards
        ref.close()
        off.close()


def test_device_keeps_persistent_units_only():
    run_ranks(_memory_body, 2, timeout=120, threads=1)


def _edit_body():
    rt = _runtime(True, False)
    _train(rt, 1, steps=1)
    with GatheredParameters([rt.module.fc.weight], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                rt.module.fc.weight.fill_(0.5)
    assert bool((rt.full_parameters()["fc.weight"] == 0.5).all())
    rt.module(torch.zeros(2, 3, dtype=torch.long))  # the edit reaches the gathered unit through the host shard
    rt.close()
    assert bool((rt.module.fc.weight == 0.5).all())


def test_gathered_parameters_edit_reaches_host_shard():
    run_ranks(_edit_body, 2, timeout=120, threads=1)


def _nvme_store(root, max_in_cpu, buffer_count=2):
    from zero_kernels.aio import AioSettings, AsyncIO
    from zero_offload import NVMeParamStore, SwapFolder

    folder = SwapFolder(root, dist.get_rank(), 1 << 20, key="offload_param.nvme_path",
                        name=f"rank{dist.get_rank()}.params")  # fmt: skip
    io = AsyncIO(AioSettings(block_size=4096), str(folder.path))
    return NVMeParamStore(folder, io, buffer_count=buffer_count, buffer_size=4096, max_in_cpu=max_in_cpu)


def _nvme_runtime(root, offload_opt, max_in_cpu=10):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    cfg = ZeroConfig(stage=3, reduce_bucket_size=40, overlap_comm=True, stage3_param_persistence_threshold=8)
    return ZeroRuntime(model, opt, cfg, PrecisionPolicy.fp32(), param_store=_nvme_store(root, max_in_cpu),
                       master_store=_master(offload_opt))  # fmt: skip


def _nvme_body(root):
    import os

    for accum, offload_opt in ((1, False), (4, True)):  # offload_param nvme + offload_optimizer cpu: DeepSpeed #4998
        ref, off = _runtime(False, False), _nvme_runtime(root, offload_opt)
        st = off.params.storage
        swapped = [b for b in st.files]
        assert swapped and st.host_chunks, "some units on NVMe, some kept in host memory (max_in_cpu)"
        names = sorted(os.listdir(st.folder.path))
        assert f"param.{swapped[0].slots[0].name}.swp" in names  # stable names: parameter names
        r0, w0 = st.io.reads, st.io.writes
        lr, lo = _train(ref, accum), _train(off, accum)
        torch.testing.assert_close(lo, lr, rtol=1e-6, atol=1e-7)
        a, b = off.full_parameters(), ref.full_parameters()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"nvme {k}: {m}")
        # one write per swapped trainable unit per step; every read either started ahead or waited for
        trainable = [b for b in swapped if b.group.group_index is not None]
        assert st.io.writes - w0 == STEPS * len(trainable), (st.io.writes - w0, len(trainable))
        assert st.io.reads == st.swap["started_ahead"] + st.swap["read_now"], st.swap
        used = [b for b in trainable if not b.persistent and not b.slots[0].name.startswith("unused")]
        assert st.io.reads - r0 >= STEPS * 2 * len(used) > 0  # each gathered in forward and again in backward
        assert st.swap["read_ahead"] > 0, st.swap  # reads started along the recorded order, then used
        ref.close()
        off.close()
        assert not os.path.exists(st.folder.path)  # zero removes its own files on close
    return True


def test_param_offload_nvme_matches_stage3(tmp_path):
    assert all(run_ranks(_nvme_body, 2, str(tmp_path), timeout=240, threads=1))
    assert not (tmp_path / "zero_swap").exists()


def _small_buffer_body(root):
    with pytest.raises(ValueError, match=r"offload_param\.buffer_size=4096 .*offload_param\.buffer_count"):
        torch.manual_seed(0)
        model = nn.Linear(100, 100)
        opt = torch.optim.AdamW(model.parameters())
        ZeroRuntime(model, opt, ZeroConfig(stage=3, stage3_param_persistence_threshold=8),
                    param_store=_nvme_store(root, 0))  # fmt: skip
    return True


def test_param_offload_nvme_buffer_too_small_names_both_keys(tmp_path):
    assert all(run_ranks(_small_buffer_body, 2, str(tmp_path), timeout=120, threads=1))


def _zero_init_body():
    from zero_core import zero_init

    def wrap(under, offload):
        torch.manual_seed(0)
        if under:
            with zero_init():
                model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
        else:
            model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=20)
        return ZeroRuntime(model, opt, cfg, param_store=OffloadParamStore() if offload else None)

    ref, off = wrap(False, False), wrap(True, True)  # a model built partitioned, its shards moved to host memory
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(dist.get_rank()))
    for rt in (ref, off):
        rt.backward(rt.module(x).square().mean(), is_boundary=True)
        rt.step()
    a, b = off.full_parameters(), ref.full_parameters()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k: f"zero_init {k}: {m}")
    ref.close()
    off.close()
    return True


def test_param_offload_of_a_model_built_under_zero_init():
    assert all(run_ranks(_zero_init_body, 2, timeout=120, threads=1))
