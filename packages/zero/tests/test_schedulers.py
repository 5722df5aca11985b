"""Per-step learning rates of the config-built schedules equal DeepSpeed's documented formulas."""

import math

import pytest
import torch

from zero.config import load_config
from zero.optim import build_optimizer, build_scheduler


def _lrs(sched_type: str, params: dict, steps: int, opt_lr: float = 0.1, opt_type: str = "AdamW"):
    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": opt_type, "params": {"lr": opt_lr}},
                       "scheduler": {"type": sched_type, "params": params}}, 1)  # fmt: skip
    opt = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(3))])
    sched = build_scheduler(cfg.scheduler, opt)
    out = []
    for _ in range(steps):
        sched.step()
        out.append(opt.param_groups[0]["lr"])
        assert sched.get_last_lr() == [out[-1]]
    return out, opt, sched


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    lrs, _, _ = _lrs("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 10,
                                  "warmup_type": kind}, 15)  # fmt: skip
    for t, lr in enumerate(lrs):
        frac = (math.log(t + 1) / math.log(10) if kind == "log" else t / 10) if t < 10 else 1.0
        assert lr == pytest.approx(0.01 + 0.04 * frac, rel=1e-12, abs=1e-15)


def test_warmup_decay_lr():
    lrs, _, _ = _lrs("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 4,
                                       "total_num_steps": 12, "warmup_type": "linear"}, 14)  # fmt: skip
    for t, lr in enumerate(lrs):
        gamma = t / 4 if t < 4 else max(0.0, (12 - t) / 8)
        assert lr == pytest.approx(0.02 * gamma, abs=1e-15)
    assert lrs[-1] == 0.0


def test_warmup_cosine_lr():
    lrs, _, _ = _lrs("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                                        "cos_min_ratio": 0.01}, 22, opt_lr=0.3)  # fmt: skip
    for t, lr in enumerate(lrs):
        if t < 5:
            ratio = 0.1 + 0.9 * math.log(t + 1) / math.log(5)
        else:
            ratio = max(0.0, 0.01 + 0.99 * (1 + math.cos(math.pi * min(1.0, (t - 4) / 15))) / 2)  # clamped
        assert lr == pytest.approx(0.3 * ratio, rel=1e-12)


def test_one_cycle_lr_and_momentum():
    params = {
        "cycle_min_lr": 0.01,
        "cycle_max_lr": 0.1,
        "cycle_first_step_size": 4,
        "cycle_second_step_size": 6,
        "decay_step_size": 2,
        "decay_lr_rate": 0.5,
        "cycle_min_mom": 0.85,
        "cycle_max_mom": 0.95,
    }
    lrs, opt, _ = _lrs("OneCycle", params, 1)
    assert opt.param_groups[0]["betas"][1] == 0.999
    lrs, opt, sched = _lrs("OneCycle", params, 16)
    for t, lr in enumerate(lrs):
        if t < 10:
            x = (t + 1) / 10 - math.floor((t + 1) / 10)
            scale = x / 0.4 if x <= 0.4 else (x - 1) / (0.4 - 1)
            assert lr == pytest.approx(0.01 + 0.09 * scale, rel=1e-12)
        else:
            assert lr == pytest.approx(0.01 / (1 + 0.5 * (t - 10 + 1) / 2), rel=1e-12)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.95)  # decay_mom_rate 0: stays at cycle_max_mom


def test_scheduler_state_round_trip():
    # warmup_max_lr explicit: its default (None) reads the group's lr, which the first schedule has changed
    _, opt, sched = _lrs("WarmupLR", {"warmup_num_steps": 10, "warmup_max_lr": 0.1}, 3)
    state = sched.state_dict()
    assert state == {"last_batch_iteration": 2}
    section = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.1}}
    fresh = build_scheduler(load_config({"train_batch_size": 2, "scheduler": section}, 1).scheduler, opt)
    fresh.load_state_dict(state)
    fresh.step()
    sched.step()
    assert fresh.get_last_lr() == sched.get_last_lr()
