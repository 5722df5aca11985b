"""``deepspeed.runtime.lr_schedules`` on the cases where DeepSpeed 0.19.8's behaviour is easy to miss: a tensor
learning rate stays the same tensor, an unknown ``warmup_type`` falls back to ``log``, ``LRRangeTest`` lives at
that module path. Expected values are DeepSpeed's documented formulas, computed here.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from zero.as_deepspeed.runtime import lr_schedules


def _opt(lr) -> torch.optim.Optimizer:
    return torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=lr)


@pytest.mark.parametrize("kind", ["linear", "log"])
def test_warmup_lr_keeps_a_tensor_lr(kind):
    lr = torch.tensor(0.01)
    opt = _opt(lr)
    lo, hi, warmup = 0.001, 0.01, 5
    sched = lr_schedules.WarmupLR(opt, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=warmup, warmup_type=kind)
    values = [float(lr)]
    for _ in range(7):
        sched.step()
        assert opt.param_groups[0]["lr"] is lr and sched.get_last_lr()[0] is lr  # the same tensor, filled
        values.append(float(lr))
    expected = [lo]
    for it in range(7):
        frac = it / warmup if kind == "linear" else math.log(it + 1) / math.log(warmup)
        expected.append(lo + (hi - lo) * frac if it < warmup else hi)
    assert values == pytest.approx(expected, rel=1e-6)  # float32 tensor: 1e-6 relative


def test_warmup_lr_default_max_reads_the_tensor_lr():
    opt = _opt(torch.tensor(0.02))
    sched = lr_schedules.WarmupLR(opt, warmup_min_lr=0.0, warmup_num_steps=4, warmup_type="linear")
    for _ in range(6):
        sched.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.02)


@pytest.mark.parametrize("cls", ["WarmupCosineLR", "WarmupLR", "WarmupDecayLR"])
def test_unknown_warmup_type_falls_back_to_log(cls, caplog):
    warmup, base = 8, 0.1
    with caplog.at_level(logging.WARNING, logger="zero"):
        if cls == "WarmupCosineLR":
            sched = lr_schedules.WarmupCosineLR(_opt(base), total_num_steps=20, warmup_min_ratio=0.1,
                                                warmup_num_steps=warmup, warmup_type="cubic")  # fmt: skip
        elif cls == "WarmupLR":
            sched = lr_schedules.WarmupLR(_opt(base), 0.0, base, warmup, "cubic")
        else:
            sched = lr_schedules.WarmupDecayLR(_opt(base), 20, 0.0, base, warmup, "cubic")
    assert sched.warmup_type == "log" and "'cubic' is unknown" in caplog.text
    for it in range(warmup):
        sched.step()
        frac = math.log(it + 1) / math.log(warmup)
        want = base * (0.1 + 0.9 * frac) if cls == "WarmupCosineLR" else base * frac
        assert sched.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12), it


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_at_its_module_path(staircase):
    opt = _opt(1.0)
    sched = lr_schedules.LRRangeTest(opt, lr_range_test_min_lr=0.002, lr_range_test_step_size=3,
                                     lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)  # fmt: skip
    assert opt.param_groups[0]["lr"] == 0.002
    for it in range(8):
        sched.step()
        interval = (it + 1) / 3
        interval = math.floor(interval) if staircase else interval
        assert opt.param_groups[0]["lr"] == pytest.approx(0.002 * (1 + 0.5 * interval), rel=1e-12)
    assert "LRRangeTest" in lr_schedules.VALID_LR_SCHEDULES and "LRRangeTest" in lr_schedules.__all__
