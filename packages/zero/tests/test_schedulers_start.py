"""Every schedule's lr is in the optimizer before the first step, and its defaults are
DeepSpeed 0.19.8's (``deepspeed/runtime/lr_schedules.py``), one by one.

"lr at step k" is the lr the k-th optimizer step runs at (0-based here: steps 0-3), i.e. the param group's lr read
just before ``optimizer.step()``; the scheduler is stepped after each optimizer step, as the engine does.
"""

import inspect
import math

import pytest
import torch

from zero.config import load_config
from zero.optim import SCHEDULERS, build_optimizer, build_scheduler


def _used_lrs(sched_type: str, params: dict, steps: int = 4, opt_lr: float = 0.1, opt_type: str = "AdamW"):
    cfg = load_config({"train_batch_size": 2, "optimizer": {"type": opt_type, "params": {"lr": opt_lr}},
                       "scheduler": {"type": sched_type, "params": params}}, 1)  # fmt: skip
    opt = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(3))])
    sched = build_scheduler(cfg.scheduler, opt)
    used = []
    for _ in range(steps):
        used.append(opt.param_groups[0]["lr"])  # what optimizer.step() would use now
        sched.step()
    return used, opt, sched


def test_warmup_lr_starts_at_min_lr():
    used, _, sched = _used_lrs("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 4,
                                            "warmup_type": "linear"})  # fmt: skip
    assert used == pytest.approx([0.01, 0.01, 0.02, 0.03], abs=1e-15)


def test_warmup_lr_default_max_is_the_optimizers_lr():
    used, _, _ = _used_lrs("WarmupLR", {"warmup_num_steps": 4, "warmup_type": "linear"}, steps=6, opt_lr=0.2)
    assert used == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2], abs=1e-15)


def test_warmup_decay_lr_first_steps_run_at_warmup_min_lr():
    used, _, _ = _used_lrs("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                             "total_num_steps": 10, "warmup_type": "linear"})  # fmt: skip
    assert used == pytest.approx([0.0, 0.0, 0.0025, 0.005], abs=1e-15)


def test_warmup_cosine_lr_starts_at_zero():
    used, _, _ = _used_lrs("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4, "warmup_min_ratio": 0.2,
                                              "warmup_type": "linear"}, opt_lr=0.5)  # fmt: skip
    assert used == pytest.approx([0.0, 0.5 * 0.2, 0.5 * (0.2 + 0.8 / 4), 0.5 * (0.2 + 0.8 * 2 / 4)], abs=1e-15)


def test_warmup_cosine_lr_stays_at_floor_after_total_steps():
    used, _, _ = _used_lrs("WarmupCosineLR", {"total_num_steps": 6, "warmup_num_steps": 2, "cos_min_ratio": 0.1,
                                              "warmup_type": "linear"}, steps=12, opt_lr=1.0)  # fmt: skip
    assert used[6:] == pytest.approx([0.1] * 6, abs=1e-12)  # DeepSpeed 0.19.8 clamps; it used to rise again


def test_one_cycle_starts_at_min_lr_and_min_momentum():
    used, opt, _ = _used_lrs("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 4},
                             steps=1)  # fmt: skip
    assert used == [0.01]
    used, opt, _ = _used_lrs("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.05, "cycle_first_step_size": 4})
    assert used == pytest.approx([0.01, 0.02, 0.03, 0.04], abs=1e-15)
    assert opt.param_groups[0]["betas"][1] == 0.999  # beta2 kept (DeepSpeed writes 0.99; see the module docstring)


def test_one_cycle_stairs():
    params = {"cycle_min_lr": 0.0, "cycle_max_lr": 0.4, "cycle_first_step_size": 4, "cycle_first_stair_count": 2}
    used, _, _ = _used_lrs("OneCycle", params, steps=9)
    # step k runs at iteration k-1, position p = k % 8 in the cycle: floor(p * 2 / 4) / 2 rising (p <= 4),
    # floor((8 - p) * 2 / 4) / 2 falling; step 0 at the construction lr (cycle_min_lr)
    assert used == pytest.approx([0.0, 0.0, 0.2, 0.2, 0.4, 0.2, 0.2, 0.0, 0.0], abs=1e-15)


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase):
    params = {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 2.0,
              "lr_range_test_staircase": staircase}  # fmt: skip
    used, _, _ = _used_lrs("LRRangeTest", params)
    grow = [0, 0.5, 1, 1.5] if not staircase else [0, 0, 1, 1]  # (it + 1) / step_size at it = -1, 0, 1, 2
    assert used == pytest.approx([0.01 * (1 + 2.0 * g) for g in grow], abs=1e-15)


def test_lr_zero_is_accepted_and_stays_zero():
    used, _, _ = _used_lrs("WarmupLR", {"warmup_num_steps": 2}, steps=3, opt_lr=0.0)
    assert used == [0.0, 0.0, 0.0]


# DeepSpeed 0.19.8's signature defaults (deepspeed/runtime/lr_schedules.py), read from its source.
DS_DEFAULTS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
                      "last_batch_iteration": -1},
    "WarmupCosineLR": {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                       "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"decay_lr_rate": 0.0, "cycle_first_step_size": 2000, "cycle_second_step_size": None,
                 "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
                 "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9, "decay_mom_rate": 0.0,
                 "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(DS_DEFAULTS))
def test_defaults_equal_deepspeed_0_19_8(name):
    sig = inspect.signature(SCHEDULERS[name])
    ours = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    assert ours == DS_DEFAULTS[name]
    # the config section fills the same defaults when a key is absent
    from zero.config.optim_sections import SCHEDULER_PARAMS

    fields = SCHEDULER_PARAMS[name].model_fields
    config_defaults = {k: f.default for k, f in fields.items() if not f.is_required()}
    assert config_defaults == DS_DEFAULTS[name]


@pytest.mark.parametrize("name,params,key", [
    ("WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps"),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 0}, "warmup_num_steps"),
    ("LRRangeTest", {"lr_range_test_step_size": 0}, "lr_range_test_step_size"),
])  # fmt: skip
def test_non_positive_step_counts_are_rejected_naming_the_key(name, params, key):
    from zero.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        _used_lrs(name, params)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    args = {"total_num_steps": 5} if name == "WarmupCosineLR" else {}
    with pytest.raises(ValueError, match=key):
        SCHEDULERS[name](opt, **args, **{key: 0})


def test_resumed_schedule_does_not_rewrite_lr_at_construction():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    SCHEDULERS["WarmupLR"](opt, warmup_min_lr=0.0, warmup_num_steps=4, last_batch_iteration=5)
    assert opt.param_groups[0]["lr"] == 0.3
    assert math.isclose(SCHEDULERS["WarmupLR"](opt, warmup_num_steps=4).get_last_lr()[0], 0.0)
