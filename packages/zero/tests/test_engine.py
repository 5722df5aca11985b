"""Engine semantics on one and two gloo ranks: accumulation boundary, scheduler stepping, skipped steps,
observers wired from the config (wall_clock_breakdown, flops_profiler, memory_breakdown)."""

import contextlib
import io

import pytest
import torch

import zero
from zero_comm.testing import run_ranks


def _net():
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.GELU(), torch.nn.Linear(13, 4))


def _cfg(**extra):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                                        "warmup_num_steps": 10, "warmup_type": "linear"}}}  # fmt: skip
    cfg.update(extra)
    return cfg


def boundary_body(stage: int) -> dict:
    engine, opt, _, sched = zero.initialize(model=_net(), config=_cfg(zero_optimization={"stage": stage}))
    flags, lrs = [], []
    for i in range(6):
        x = torch.rand(2, 8, generator=torch.Generator().manual_seed(i + 10 * torch.distributed.get_rank()))
        flags.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(x).square().mean())
        engine.step()
        lrs.append(engine.get_lr()[0])
    return {"flags": flags, "lrs": lrs, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "norm": engine.get_global_grad_norm(), "batch": engine.train_batch_size()}  # fmt: skip


@pytest.mark.smoke
@pytest.mark.parametrize("stage", [0, 2])
def test_step_acts_only_at_accumulation_boundary(stage):
    for out in run_ranks(boundary_body, 2, stage, timeout=60):
        assert out["flags"] == [False, False, True, False, False, True]
        assert out["global_steps"] == 2 and out["micro_steps"] == 6
        # WarmupLR (linear): warmup_min_lr 0.0 from construction, then iteration 0 (0.0) and 1 (0.01) at the
        # boundaries; unchanged between boundaries.
        assert out["lrs"] == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.0, 0.01])
        assert out["norm"] is not None and out["norm"] > 0
        assert out["batch"] == 2 * 3 * 2


def skip_body() -> dict:
    engine, _, _, _ = zero.initialize(model=_net(), config=_cfg(gradient_accumulation_steps=1))
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(torch.rand(2, 8)).sum() * float("inf"))
    engine.step()
    after = [p.detach().clone() for p in engine.module.parameters()]
    return {"skipped": engine.skipped_steps, "lr_iter": engine.lr_scheduler.last_batch_iteration,
            "same": all(torch.equal(a, b) for a, b in zip(before, after))}  # fmt: skip


def test_overflow_step_is_skipped_and_scheduler_does_not_advance():
    for out in run_ranks(skip_body, 2, timeout=60):
        assert out == {"skipped": 1, "lr_iter": -1, "same": True}


def observer_body() -> str:
    # Return what the observers print: a warm worker's stdout is not the test's captured stdout.
    cfg = _cfg(gradient_accumulation_steps=1, steps_per_print=1, wall_clock_breakdown=True, memory_breakdown=True,
               flops_profiler={"enabled": True, "profile_step": 2})  # fmt: skip
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        engine, _, _, _ = zero.initialize(model=_net(), config=cfg)
        for _ in range(3):
            engine.backward(engine(torch.rand(2, 8)).sum())
            engine.step()
    return buf.getvalue()


def test_observers_report_from_config():
    out = run_ranks(observer_body, 1, timeout=60)[0]
    assert "forward" in out and "backward" in out  # wall_clock_breakdown
    assert "step 2" in out  # flops profile of step 2 / timers at steps_per_print
    assert "model states" in out  # memory_breakdown
