"""The DeepSpeed-style script (ds_style_train.py) runs unchanged under ``import zero as deepspeed`` on 2 ranks and
matches a single-process PyTorch reference (fp32: losses and parameters within 1e-6)."""

import importlib.util
import pathlib

import pytest
import torch
from torch.utils.data import DistributedSampler

from zero.optim import WarmupLR
from zero_comm.testing import run_ranks

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("ds_style_train", HERE / "ds_style_train.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
WS = 2


def body(stage: int, save_dir: str | None) -> dict:
    return script.train(["--stage", str(stage)] + (["--save-dir", save_dir] if save_dir else []))


def reference() -> tuple[list[float], dict]:
    """One process, whole global batch per step (the union of the ranks' micro-batches), torch AdamW."""
    torch.manual_seed(1234)
    model = script.TinyNet()
    cfg = script.ds_config(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = WarmupLR(opt, **cfg["scheduler"]["params"])
    data = script.dataset()
    micro, gas = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    order = [list(DistributedSampler(data, num_replicas=WS, rank=r, shuffle=True, seed=0)) for r in range(WS)]
    losses = []
    for step in range(script.STEPS):
        lo, hi = step * gas * micro, (step + 1) * gas * micro
        idx = torch.tensor([i for r in range(WS) for i in order[r][lo:hi]])
        x, y = data.tensors[0][idx], data.tensors[1][idx]
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _check_params(params: dict, ref_params: dict, rank: int) -> None:
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ds_style_script_matches_reference(stage):
    results = run_ranks(body, WS, stage, None, timeout=90)
    ref_losses, ref_params = reference()
    for r, out in enumerate(results):
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), f"rank {r}"
        assert out["global_steps"] == script.STEPS
        _check_params(out["params"], ref_params, r)
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ds_style_script_save_load_resumes_exactly(stage, tmp_path):
    results = run_ranks(body, WS, stage, str(tmp_path / "ckpt"), timeout=90)
    ref_losses, ref_params = reference()
    for r, out in enumerate(results):
        assert out["resumed"] == pytest.approx(ref_losses[script.RESUME_AT :], rel=1e-6, abs=1e-6), f"rank {r}"
        assert out["client"] == {"seen": script.RESUME_AT}
        assert out["global_steps_resumed"] == script.STEPS
        assert out["lr_resumed"] == pytest.approx(out["lr"])
        _check_params(out["params_resumed"], ref_params, r)
