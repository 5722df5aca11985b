"""Engine.resume_checkpoint (auto / must / never) and checkpoints every N steps or M minutes, on two gloo ranks:
a run stopped after a checkpoint and resumed with mode="auto" ends bitwise equal to an uninterrupted run."""

import os

import pytest
import torch

import zero
from zero.engine.resume import CheckpointInterval
from zero_comm.testing import run_ranks

STEPS = 6


def _engine():
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}}  # fmt: skip
    return zero.initialize(model=net, config=cfg)[0]


def _train(engine, ckpt, interval, stop_at=None) -> list[int]:
    """Steps to ``stop_at`` (or STEPS); data from (global step, rank) only. Returns the steps saved at."""
    saved = []
    rank = torch.distributed.get_rank()
    while engine.global_steps < (stop_at or STEPS):
        g = torch.Generator().manual_seed(100 * engine.global_steps + rank)
        engine.backward(engine(torch.randn(2, 8, generator=g)).square().mean())
        engine.step()
        if engine.save_checkpoint_if_due(ckpt, interval) is not None:
            saved.append(engine.global_steps)
    return saved


def resume_body(ckpt: str) -> dict:
    plain = _engine()
    assert plain.resume_checkpoint(ckpt + "-none", mode="auto") is None  # no checkpoint: start fresh
    _train(plain, ckpt + "-unused", CheckpointInterval())
    first = _engine()
    saved = _train(first, ckpt, CheckpointInterval(every_steps=2), stop_at=5)  # "killed" after step 5
    second = _engine()
    path = second.resume_checkpoint(ckpt, mode="auto")
    resumed_at = second.global_steps
    _train(second, ckpt, CheckpointInterval(every_steps=2))
    never = _engine().resume_checkpoint(ckpt, mode="never")
    same = all(torch.equal(a, b) for a, b in zip(plain.runtime.module.parameters(), second.runtime.module.parameters()))
    return {"saved": saved, "path": os.path.relpath(path, ckpt), "resumed_at": resumed_at, "never": never, "same": same}


def test_resume_auto_replays_to_the_uninterrupted_result(tmp_path):
    for out in run_ranks(resume_body, 2, str(tmp_path / "ckpt"), timeout=120):
        assert out == {
            "saved": [2, 4],
            "path": os.path.join("global_step4", "mp_rank_00_model_states.safetensors"),
            "resumed_at": 4,
            "never": None,
            "same": True,
        }


def test_resume_must_without_checkpoint_and_bad_mode(tmp_path):
    engine = _engine()
    with pytest.raises(FileNotFoundError, match="latest is missing"):
        engine.resume_checkpoint(tmp_path, mode="must")
    with pytest.raises(ValueError, match="resume mode must be one of auto, never, must"):
        engine.resume_checkpoint(tmp_path, mode="yes")


def test_interval_by_steps_and_minutes(monkeypatch):
    every2 = CheckpointInterval(every_steps=2)
    assert [s for s in range(7) if every2.due(s)] == [2, 4, 6]
    clock = [1000.0]
    monkeypatch.setattr("zero.engine.resume.time.monotonic", lambda: clock[0])
    minutes = CheckpointInterval(every_minutes=1.5)
    assert not minutes.due(1)
    clock[0] += 89.0
    assert not minutes.due(2)
    clock[0] += 1.0
    assert minutes.due(3)
    minutes.saved()
    assert not minutes.due(4)
    for bad in ({"every_steps": 0}, {"every_minutes": 0.0}, {"every_steps": True}):
        with pytest.raises(ValueError, match="every_"):
            CheckpointInterval(**bad)
