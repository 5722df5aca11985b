"""Checkpoints with offloaded optimizer state: bit-exact resume, offloaded <-> not offloaded both ways, N-to-M
resharding (2 ranks -> 3 ranks) and consolidation, for host memory and NVMe."""

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import consolidate, load_checkpoint, save_checkpoint
from zero_kernels.aio import AioSettings
from zero_offload import master_store_for


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def build(stage, offload, seed, nvme_root=None):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    section = {"stage": stage, "reduce_bucket_size": 50, "sub_group_size": 40}
    if offload == "cpu":
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif offload == "nvme":
        section["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 2}
    cfg = ZeroConfig.model_validate(section)
    master = master_store_for(cfg, model, dist.get_world_size(), dist.get_rank(), AioSettings(block_size=8192))
    return ZeroRuntime(model, opt, cfg, PrecisionPolicy.fp32(), master_store=master)


def train(rt, steps, first):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
        rt.backward(nn.functional.mse_loss(rt.module(x), y))
        rt.step()


def state(rt):
    out = {f"param/{k}": v for k, v in rt.full_parameters().items()}
    for g in rt.flat_groups:
        if g.group_index is not None:
            for k, v in rt.master.state_shard(g).items():
                out[f"state/{g.index}/{k}"] = torch.as_tensor(v).detach().clone()
    return out


def same(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _round_trips(root, nvme_root):
    for stage in (1, 2, 3):
        for saver, loader in (("cpu", "none"), ("none", "cpu"), ("cpu", "cpu"), ("nvme", "none"), ("none", "nvme")):
            what = f"stage {stage} save {saver} load {loader}"
            d = f"{root}/s{stage}-{saver}-{loader}"
            control = build(stage, "none", 1, nvme_root)
            train(control, 4, 0)
            run = build(stage, saver, 1, nvme_root)
            train(run, 2, 0)
            save_checkpoint(run, d, "step2")
            run.close()
            fresh = build(stage, loader, 9, nvme_root)
            load_checkpoint(fresh, d)
            train(fresh, 2, 2)
            got, want = state(fresh), state(control)
            for k in want:  # CPU Adam vs torch's AdamW: equal to the last bits (1e-6 relative)
                torch.testing.assert_close(
                    got[k], want[k], rtol=1e-6, atol=1e-7, msg=lambda m, k=k, w=what: f"{w} {k}: {m}"
                )
            if saver == loader:  # the same path on both sides: bit-exact resume
                again = build(stage, saver, 1, nvme_root)
                train(again, 4, 0)
                same(state(fresh), state(again), what + " bit-exact")
                again.close()
            fresh.close()
            control.close()


def test_round_trips_offloaded_and_not(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    run_ranks(_round_trips, 2, str(tmp_path), str(nvme), timeout=300, threads=1)
    assert not (nvme / "zero_swap").exists()  # clean closes removed zero's swap files and folders


def _save_two(root, nvme_root):
    rt = build(3, "nvme", 1, nvme_root)
    train(rt, 2, 0)
    save_checkpoint(rt, root, "two")
    full = rt.full_parameters()
    rt.close()
    return full


def _load_three(root, offload, nvme_root):  # 2 NVMe ranks -> 3 ranks in host memory or on NVMe
    rt = build(3, offload, 5, nvme_root)
    load_checkpoint(rt, root, "two")
    out = rt.full_parameters()
    st = {g.index: rt.master.state_shard(g) for g in rt.flat_groups if g.group_index is not None}
    rt.close()
    return out, all(float(s["step"]) == 2.0 for s in st.values())


def test_n_to_m_and_consolidation(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    saved = run_ranks(_save_two, 2, str(tmp_path / "ck"), str(nvme), timeout=120, threads=1)[0]
    loaded = run_ranks(_load_three, 3, str(tmp_path / "ck"), "cpu", None, timeout=120, threads=1)
    loaded += run_ranks(_load_three, 3, str(tmp_path / "ck"), "nvme", str(nvme), timeout=120, threads=1)
    for full, steps_ok in loaded:
        assert steps_ok
        for k, v in saved.items():
            assert torch.equal(full[k], v), k
    out = consolidate(tmp_path / "ck", tmp_path / "out", tag="two")
    from safetensors.torch import load_file

    flat = load_file(str(out / "model.safetensors")) if out.is_dir() else load_file(str(out))
    for k, v in saved.items():
        assert torch.equal(flat[k], v), k


def _enospc_body(root, nvme_root):
    import errno

    import pytest

    from zero_kernels.aio import AioError

    rt = build(2, "nvme", 1, nvme_root)
    train(rt, 1, 0)
    save_checkpoint(rt, root, "before")
    want = state(rt)
    rt.master.store.io.inject_error(True, errno.ENOSPC)  # the disk fills up during the next step's writes
    with pytest.raises(AioError, match=r"write of '.*\.swp' at offset \d+, \d+ bytes failed: No space left"):
        train(rt, 1, 1)
    rt.close()
    fresh = build(2, "cpu", 3, None)
    load_checkpoint(fresh, root, "before")  # the previous checkpoint is intact
    same(state(fresh), want, "after ENOSPC")
    fresh.close()
    return True


def test_enospc_mid_step_names_the_file_and_keeps_the_checkpoint(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    assert all(run_ranks(_enospc_body, 2, str(tmp_path / "ck"), str(nvme), timeout=120, threads=1))
