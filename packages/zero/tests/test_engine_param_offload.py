"""The engine with ``offload_param: cpu`` at stage 3: same losses and weights as stage 3 without it (with and
without ``offload_optimizer: cpu``), checkpoints both ways, the parameter store in place."""

import os

import torch

import zero
from zero_comm.testing import run_ranks
from zero_offload import HostShards, NVMeShards


def _net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(9, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))


def _cfg(param=False, opt=False):
    zo = {"stage": 3, "stage3_param_persistence_threshold": 40}  # weights sharded, biases persistent
    if param:
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    if opt:
        zo["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": zo}  # fmt: skip


def _train(engine, steps):
    rank, losses = torch.distributed.get_rank(), []
    for i in range(steps * 2):
        g = torch.Generator().manual_seed(100 * i + rank)
        loss = engine(torch.randn(2, 9, generator=g)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def parity_body(root):
    ref, *_ = zero.initialize(model=_net(), config=_cfg())
    lr = _train(ref, 3)
    for opt in (False, True):
        off, *_ = zero.initialize(model=_net(), config=_cfg(param=True, opt=opt))
        assert isinstance(off.runtime.params.storage, HostShards)  # stage 3 with its shards in host memory
        torch.testing.assert_close(_train(off, 3), lr, rtol=1e-6, atol=1e-7)
        for (n, a), b in zip(ref.runtime.full_parameters().items(), off.runtime.full_parameters().values()):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=n)
        off.save_checkpoint(root, f"off{opt}")
        back, *_ = zero.initialize(model=_net(), config=_cfg())  # offloaded checkpoint -> no offload
        back.load_checkpoint(root, f"off{opt}")
        torch.testing.assert_close(_train(back, 1), _train(off, 1), rtol=1e-6, atol=1e-7)
        back.destroy()
        off.destroy()
    ref.save_checkpoint(root, "ref")
    fwd, *_ = zero.initialize(model=_net(), config=_cfg(param=True))  # and the reverse
    fwd.load_checkpoint(root, "ref")
    torch.testing.assert_close(_train(fwd, 1), _train(ref, 1), rtol=1e-6, atol=1e-7)
    fwd.destroy()
    ref.destroy()
    return True


def test_engine_param_offload_matches_and_checkpoints_cross(tmp_path):
    assert all(run_ranks(parity_body, 2, str(tmp_path), timeout=240, threads=1))


def nvme_body(root):
    ref, *_ = zero.initialize(model=_net(), config=_cfg())
    cfg = _cfg(opt=True)  # offload_param nvme with offload_optimizer cpu (DeepSpeed #4998 crashes there)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": root, "max_in_cpu": 0,
                                                 "buffer_count": 2, "buffer_size": 4096}  # fmt: skip
    off, *_ = zero.initialize(model=_net(), config=cfg)
    assert isinstance(off.runtime.params.storage, NVMeShards)
    torch.testing.assert_close(_train(off, 3), _train(ref, 3), rtol=1e-6, atol=1e-7)
    assert off.runtime.params.storage.io.reads > 0 and off.runtime.params.storage.io.writes > 0
    ckpt = os.path.join(root, "ckpt")
    off.save_checkpoint(ckpt, "nvme")
    back, *_ = zero.initialize(model=_net(), config=_cfg())  # NVMe-offloaded checkpoint -> no offload
    back.load_checkpoint(ckpt, "nvme")
    ref.save_checkpoint(ckpt, "ref")
    fwd, *_ = zero.initialize(model=_net(), config=cfg)  # and the reverse: into swap files
    fwd.load_checkpoint(ckpt, "ref")
    # two live engines: two swap folders
    assert fwd.runtime.params.storage.folder.path != off.runtime.params.storage.folder.path
    lb, lo = _train(back, 1), _train(off, 1)
    torch.testing.assert_close(lb, lo, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_train(fwd, 1), _train(ref, 1), rtol=1e-6, atol=1e-7)
    for e in (off, back, fwd, ref):
        e.destroy()
    return True


def test_engine_param_offload_nvme_with_optimizer_on_cpu(tmp_path):
    assert all(run_ranks(nvme_body, 2, str(tmp_path), timeout=240, threads=1))
    assert not (tmp_path / "zero_swap").exists()
