"""Crash safety with optimizer state on NVMe: a rank SIGKILLed mid-step or mid-save leaves the last checkpoint
loadable, and a run resumed from it (on the same ``nvme_path``, over the dead run's swap files) is bitwise the
uninterrupted run."""

import os
import signal

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import RankFailure, run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import load_checkpoint, save_checkpoint
from zero_kernels.aio import AioSettings
from zero_offload import master_store_for


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def build(stage, nvme_root, seed=1):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    section = {"stage": stage, "reduce_bucket_size": 50, "sub_group_size": 40,
               "offload_optimizer": {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 2}}  # fmt: skip
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
    out = {f"param/{k}": v.clone() for k, v in rt.full_parameters().items()}
    for g in rt.flat_groups:
        if g.group_index is not None:
            for k, v in rt.master.state_shard(g).items():
                out[f"state/{g.index}/{k}"] = torch.as_tensor(v).detach().clone()
    return out


def _reference(stage, nvme_root):
    rt = build(stage, nvme_root)
    train(rt, 4, 0)
    out = state(rt)
    rt.close()
    return out


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _train_and_die(stage, ck, nvme_root, where):
    rt = build(stage, nvme_root)
    train(rt, 2, 0)
    save_checkpoint(rt, ck, "step2")
    if where == "step":  # rank 1 dies after the first swap write of step 3 is submitted: its files are torn
        io = rt.master.store.io
        write = io.write

        def write_then_die(*a, **k):
            handle = write(*a, **k)
            if dist.get_rank() == 1:
                _die()
            return handle

        io.write = write_then_die
        train(rt, 1, 2)
    else:  # rank 1 dies while saving step 3: its shard files written to the staging folder, nothing committed
        train(rt, 1, 2)
        import zero_core.checkpoint.save as save_module

        write_rank_files = save_module.write_rank_files

        def write_then_die(*a, **k):
            out = write_rank_files(*a, **k)
            if dist.get_rank() == 1:
                _die()
            return out

        save_module.write_rank_files = write_then_die
        save_checkpoint(rt, ck, "step3")
    return "survived"


def _resume(stage, ck, nvme_root):
    rt = build(stage, nvme_root, seed=7)
    load_checkpoint(rt, ck)  # the tag in ``latest``
    train(rt, 2, 2)
    out = state(rt)
    rt.close()
    return out


@pytest.mark.parametrize("stage,where", [(2, "step"), (3, "save")])
def test_sigkill_leaves_last_checkpoint_that_resumes_bitwise(tmp_path, stage, where):
    ref_root, nvme = tmp_path / "ref", tmp_path / "nvme"
    ref_root.mkdir()
    nvme.mkdir()
    want = run_ranks(_reference, 2, stage, str(ref_root), timeout=120, threads=1)
    ck = str(tmp_path / "ck")
    with pytest.raises(RankFailure, match="died") as failure:
        run_ranks(_train_and_die, 2, stage, ck, str(nvme), where, timeout=120, pg_timeout=30, threads=1)
    assert failure.value.rank == 1
    assert (tmp_path / "ck" / "latest").read_text().strip() == "step2"
    assert not (tmp_path / "ck" / "step3").exists()
    left = sorted(os.listdir(nvme / "zero_swap" / "rank1"))  # the dead rank's swap files are still there
    assert any(name.endswith(".swp") for name in left), left
    got = run_ranks(_resume, 2, stage, ck, str(nvme), timeout=120, threads=1)
    for rank in range(2):
        assert got[rank].keys() == want[rank].keys()
        for k in want[rank]:
            assert torch.equal(got[rank][k], want[rank][k]), f"rank {rank} {k} differs after resume"
    assert not (nvme / "zero_swap").exists()  # the resumed run cleared the dead run's files and closed cleanly
