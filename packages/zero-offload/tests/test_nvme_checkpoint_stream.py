"""Checkpoint save with NVMe-resident state: the master and Adam state stream from the swap files
into the rank's safetensors file one sub-group segment at a time, through the first swap buffer; no whole shard is
read into host memory (the whole-shard readers are made to fail during the save), the largest read is one
sub-group, and the file holds exactly the state (compared with the values read back the old way). Stage 3 with
streamed gradients (both offloads on NVMe) and stage 2; an asynchronous save is read before ``save_checkpoint``
returns (a step right after it does not reach the checkpoint); loading it into a run without offload gives the
same parameters and state. Round trips, N-to-M resharding, consolidation and crashes mid-save with NVMe state are
in test_offload_checkpoint.py and test_nvme_crash.py (they now go through this path too). A load into a run with
its state on NVMe reads no whole shard either."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import load_checkpoint, save_checkpoint
from zero_core.checkpoint.reshard import master_key, optim_key
from zero_core.checkpoint.storage import optim_states_name
from zero_kernels.aio import AioSettings
from zero_offload import master_store_for, param_store_for


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(7, 9), nn.Linear(9, 8), nn.Linear(8, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def build(stage, nvme_root, seed=1):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    section = {"stage": stage, "reduce_bucket_size": 50, "sub_group_size": 24, "stage3_param_persistence_threshold": 4}
    if nvme_root is not None:
        section["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 2}
        if stage == 3:
            section["offload_param"] = {"device": "nvme", "nvme_path": nvme_root, "buffer_count": 2,
                                        "buffer_size": 4096, "max_in_cpu": 0}  # fmt: skip
    cfg = ZeroConfig.model_validate(section)
    world, rank, aio = dist.get_world_size(), dist.get_rank(), AioSettings(block_size=4096)
    master = master_store_for(cfg, model, world, rank, aio) if nvme_root else None
    params = param_store_for(cfg, model, world, rank, aio) if nvme_root and stage == 3 else None
    return ZeroRuntime(model, opt, cfg, PrecisionPolicy.fp32(), master_store=master, param_store=params)


def train(rt, steps, first=0):
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


def _forbid_whole_shards(store):
    def whole(*args, **kwargs):
        raise AssertionError("a checkpoint save or load read a whole shard into host memory")

    store.master_shard = store.shard_state = whole


def _body(stage, root, nvme_root):
    rank = dist.get_rank()
    rt = build(stage, nvme_root)
    train(rt, 2)
    store = rt.master.store
    assert stage < 3 or rt.master.takes_grad_shards  # stage 3: gradients streamed to the swap files too
    groups = [g for g in rt.flat_groups if g.group_index is not None]
    expect = {}
    for g in groups:
        expect[master_key(g.key)] = rt.master.master_shard(g).clone()
        for k, v in rt.master.state_shard(g).items():
            expect[optim_key(k, g.key)] = torch.as_tensor(v).clone()
    before = state(rt)
    _forbid_whole_shards(store)
    handle = save_checkpoint(rt, root, "streamed", async_save=True)
    n = len(store.sub_groups)
    assert sum(map(store.region_numel, store.sub_groups)) > store.ring.numel  # the ring cannot hold all
    assert len({sg.shard for sg in store.sub_groups}) < n  # several per shard
    # three segments (master, exp_avg, exp_avg_sq) of every sub-group, each read alone: one sub-group at most;
    # stages 1-2 in fp32 keep the master in host memory (nothing to read for it)
    assert store.ckpt_io["reads"] == (3 - store.master_in_memory) * n, store.ckpt_io
    assert store.master_in_memory == (stage < 3)
    assert store.ckpt_io["largest"] == max(store._pad) * 4, store.ckpt_io  # one sub-group (padded to 4 KiB)
    assert max(sg.numel for sg in store.sub_groups) < max(store.numels)  # ... less than a shard
    del store.master_shard, store.shard_state
    train(rt, 1, first=2)  # rewrites the swap files: the asynchronous save must already have read them
    handle.wait()
    saved = load_file(f"{root}/streamed/{optim_states_name(rank)}.safetensors")
    for k, v in expect.items():
        assert torch.equal(saved[k], v.reshape(saved[k].shape)), k
    rt.close()
    plain = build(stage, None, seed=5)  # no offload: the checkpoint's layout is the in-memory one
    load_checkpoint(plain, root, "streamed")
    after = state(plain)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k
    plain.close()
    # loading into a run whose state is on NVMe writes the swap files and reads no whole shard back (it once read
    # every master and state shard only to learn the optimizer's parameter order)
    again = build(stage, nvme_root, seed=5)
    train(again, 1)  # state on the swap files that the load replaces
    _forbid_whole_shards(again.master.store)
    load_checkpoint(again, root, "streamed")
    del again.master.store.master_shard, again.master.store.shard_state
    after = state(again)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    again.close()
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_save_streams_nvme_state_one_sub_group_at_a_time(tmp_path, stage):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    assert all(run_ranks(_body, 2, stage, str(tmp_path / "ck"), str(nvme), timeout=180, threads=1))
    assert not (nvme / "zero_swap").exists()
