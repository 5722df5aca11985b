"""The fp16 loss scaler read through DeepSpeed's names, with an overflow on one rank only.

fp16 with ``loss_scale: 0``, ``initial_scale_power: 10``, ``hysteresis: 2``, ``min_loss_scale: 1`` on 2 gloo ranks;
rank 1's loss is multiplied by inf on the overflow steps. After each step, ``engine.optimizer.cur_scale`` (and
``loss_scale``) must follow DeepSpeed's ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``), be the
same on both ranks, the parameters must be unchanged on overflow steps and ``engine.skipped_steps`` count them.
The expected scales come from :func:`deepspeed_scales`, DeepSpeed's documented rule written out here; the first
two patterns also check the literal trajectories DeepSpeed prints for them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks

O, G = True, False  # overflow step, good step
MIXED = [O, O, G, O, G, O, O]
GROWTH = [O, G, G, G, G, G]  # window 2: the first growth comes on the 3rd good step after the overflow


def deepspeed_scales(pattern, init, window, hysteresis, consecutive, min_scale=1.0, factor=2.0):
    """DeepSpeed's DynamicLossScaler.update_scale, step by step: the scale after each step."""
    scale, cur_iter, last_overflow, cur_hyst, out = init, 0, -1, hysteresis, []
    for overflow in pattern:
        if overflow:
            if hysteresis == 1 or cur_hyst == 1:
                scale = max(scale / factor, min_scale)
            else:
                cur_hyst -= 1
            last_overflow = cur_iter
        else:
            if consecutive:
                cur_hyst = hysteresis
            stable = cur_iter - last_overflow - 1  # good iterations before this one since the last overflow
            if stable > 0 and stable % window == 0:
                if not consecutive:
                    cur_hyst = hysteresis
                scale *= factor
        cur_iter += 1
        out.append(scale)
    return out


def test_reference_rule_gives_deepspeeds_trajectories():
    assert deepspeed_scales(MIXED, 1024.0, 1000, 2, False) == [1024, 512, 512, 256, 256, 128, 64]
    assert deepspeed_scales(MIXED, 1024.0, 1000, 2, True) == [1024, 512, 512, 512, 512, 512, 256]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def scale_body(stage: int, consecutive: bool, pattern: list[bool], window: int) -> dict:
    import torch.distributed as dist

    import zero

    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": window,
                 "hysteresis": 2, "consecutive_hysteresis": consecutive, "min_loss_scale": 1},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }  # fmt: skip
    engine, optimizer, _, _ = zero.initialize(model=Net(), config=cfg)
    out = {"cur": [], "loss_scale": [], "unchanged": [], "overflow": [], "applied": [], "skipped": []}
    for step, overflow in enumerate(pattern):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank)).half()
        loss = engine(x).float().square().mean()
        if overflow and rank == 1:
            loss = loss * float("inf")
        before = engine.runtime.full_parameters()
        engine.backward(loss)
        engine.step()
        after = engine.runtime.full_parameters()
        out["unchanged"].append(all(torch.equal(before[n], after[n]) for n in before))
        out["cur"].append(engine.optimizer.cur_scale)
        out["loss_scale"].append(engine.optimizer.loss_scale)
        out["overflow"].append(engine.optimizer.overflow)
        out["applied"].append(engine.was_step_applied())
        out["skipped"].append(engine.skipped_steps)
    scaler = engine.optimizer.loss_scaler
    out["scaler"] = (scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.scale_window,
                     scaler.consecutive_hysteresis, scaler.min_scale, scaler.dynamic, scaler.delayed_shift)  # fmt: skip
    out["engine"] = (engine.loss_scale(), engine.dynamic_loss_scale(), engine.initial_dynamic_scale(),
                     engine.dynamic_loss_scale_args(), engine.optimizer.dynamic_loss_scale)  # fmt: skip
    out["same_optimizer"] = optimizer is engine.optimizer and isinstance(optimizer, torch.optim.SGD)
    out["class_name"] = type(engine.optimizer).__name__
    engine.optimizer.cur_scale = 32.0  # DeepSpeed's setter
    out["set"] = (engine.optimizer.loss_scale, engine.runtime.loss_scaler.scale)
    return out


CASES = [(stage, consecutive, "mixed") for stage in (1, 2, 3) for consecutive in (False, True)]
CASES += [(2, consecutive, "growth") for consecutive in (False, True)]  # the growth rule is the scaler's: one stage
PATTERNS = {"mixed": (MIXED, 1000), "growth": (GROWTH, 2)}


@pytest.mark.parametrize("stage, consecutive, name", CASES)
def test_loss_scale_through_deepspeeds_names(stage, consecutive, name):
    pattern, window = PATTERNS[name]
    want = deepspeed_scales(pattern, 1024.0, window, 2, consecutive)
    r0, r1 = run_ranks(scale_body, 2, stage, consecutive, pattern, window, timeout=240)
    label = f"stage {stage} consecutive {consecutive}"
    for out in (r0, r1):
        assert out["cur"] == want and out["loss_scale"] == want, f"{label}: {out['cur']} != {want}"
        assert out["unchanged"] == pattern and out["overflow"] == pattern, label  # skipped exactly on overflows
        assert out["applied"] == [not o for o in pattern], label
        assert out["skipped"] == [sum(pattern[: i + 1]) for i in range(len(pattern))], label
        assert out["scaler"] == (want[-1], len(pattern), max(i for i, o in enumerate(pattern) if o), window,
                                 consecutive, 1.0, True, 2)  # fmt: skip
        args = {"init_scale": 1024, "scale_window": window, "delayed_shift": 2, "consecutive_hysteresis": consecutive,
                "min_scale": 1.0}  # fmt: skip
        assert out["engine"] == (0.0, True, 1024, args, True), label
        assert out["same_optimizer"] and out["class_name"] == "SGD" and out["set"] == (32.0, 32.0)
    assert r0["cur"] == r1["cur"]
