"""DeepSpeed's fp32 setters (``safe_set_full_fp32_param`` / ``safe_set_local_fp32_param``) and a
``GatheredParameters(modifier_rank=0)`` edit reach the master wherever offload keeps it: host memory, a Twin-Flow
split (``ratio``) or NVMe swap files. The read-back goes through the store, and one more optimizer step starts from
the edited values, so it equals the same edit made without offload."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks

OFFLOADS = {
    "none": None,
    "cpu": {"device": "cpu"},
    "ratio 0.5": {"device": "cpu", "ratio": 0.5},
    "nvme": {"device": "nvme", "buffer_count": 2},
}


def _engine(offload: dict | None, root: str):
    import zero

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 7))
    section = {"stage": 3, "sub_group_size": 16, "reduce_bucket_size": 40}
    if offload is not None:
        section["offload_optimizer"] = dict(offload, nvme_path=root) if offload["device"] == "nvme" else offload
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "zero_optimization": section,
    }
    engine, *_ = zero.initialize(model=model, config=cfg)
    return engine


def _step(engine, step: int) -> None:
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _body(root: str) -> dict:
    import zero
    from zero.engine.param_access import safe_get_full_fp32_param, safe_set_full_fp32_param

    out = {}
    for what, offload in OFFLOADS.items():
        engine = _engine(offload, root)
        _step(engine, 0)
        w, b = engine.module[2].weight, engine.module[0].bias
        new = torch.linspace(-1, 1, 63).view(7, 9)
        safe_set_full_fp32_param(w, new)
        read = safe_get_full_fp32_param(w)
        with zero.zero.GatheredParameters([b], modifier_rank=0):
            if dist.get_rank() == 0:
                b.data.fill_(0.5)
        _step(engine, 1)
        with zero.zero.GatheredParameters([w, b]):
            out[what] = (torch.equal(read, new), w.detach().clone(), b.detach().clone())
        engine.destroy()
    return out


def test_setters_and_gathered_edits_reach_the_offloaded_master(tmp_path):
    results = run_ranks(_body, 2, str(tmp_path), timeout=240, threads=1)
    for rank, out in enumerate(results):
        _, w_ref, b_ref = out["none"]
        for what, (read_back, w, b) in out.items():
            assert read_back, f"rank {rank} {what}: safe_get_full_fp32_param did not return the value just set"
            torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7, msg=lambda m, k=what: f"{k} weight: {m}")
            torch.testing.assert_close(b, b_ref, rtol=1e-6, atol=1e-7, msg=lambda m, k=what: f"{k} bias: {m}")
