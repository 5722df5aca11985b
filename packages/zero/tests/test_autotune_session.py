"""Autotuning sessions: the memory model keeps candidates that cannot fit from ever launching (stubbed launches);
real experiments in fresh processes where one stage crashes and one hangs past its time limit, recorded as failed
while the search goes on; the best config file then loads and trains as plain PyTorch does; `zero run
--autotuning run` (DeepSpeed's spelling) tunes and then trains."""

import csv
import json
import os
import sys

import pytest
import torch

import zero
import zero.autotune.autotuner as autotuner_mod
from zero.autotune import Autotuner, Job
from zero.autotune.experiment import Outcome

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "autotune_train.py")
sys.path.insert(0, HERE)
import autotune_train  # noqa: E402

BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}}  # fmt: skip


def _write(tmp_path, cfg) -> str:
    path = str(tmp_path / "ds.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def test_candidates_that_cannot_fit_are_never_launched(tmp_path, monkeypatch):
    launched = []

    def fake_run(cmd, exp_dir, timeout, env=None):
        cfg = json.load(open(cmd[cmd.index("--deepspeed_config") + 1]))
        if "profile" in exp_dir:  # 1e7 elements of fp32 AdamW; 1 MB saved (2 MB at the peak) per sample; no overhead
            info = {"num_params": 10**7, "param_numels": [10**7], "activation_bytes": 10**6,
                    "activation_bytes_per_sample": 1e6, "optimizer_bytes": 8 * 10**7,
                    "model_state_bytes": 16 * 10**7, "peak_bytes": 16 * 10**7 + 2 * 10**6}  # fmt: skip
            json.dump(info, open(os.path.join(exp_dir, "metrics.json"), "w"))
            return Outcome("ok", info)
        stage, mb = cfg["zero_optimization"]["stage"], cfg["train_micro_batch_size_per_gpu"]
        launched.append((stage, mb))
        latency = 1.0 + 0.1 * stage
        return Outcome("ok", {"latency": latency, "throughput": 2 * mb / latency, "model_state_bytes": 1,
                              "peak_bytes": 2})  # fmt: skip

    monkeypatch.setattr(autotuner_mod, "run_experiment", fake_run)
    # Per rank of 2: stage 0 160 MB, stage 1 120 MB, stage 2 100 MB, stage 3 80 MB of model states.
    cfg = {**BASE, "autotuning": {"results_dir": str(tmp_path / "res"), "exps_dir": str(tmp_path / "exps"),
                                  "memory_per_rank": 110 * 10**6, "max_train_micro_batch_size_per_gpu": 8,
                                  "num_tuning_micro_batch_sizes": 2}}  # fmt: skip
    path = _write(tmp_path, cfg)
    tuner = Autotuner(Job(SCRIPT, ["--deepspeed_config", path], 1, nproc=2), cfg, log=lambda s: None)
    best = tuner.tune()
    assert {s for s, _ in launched} == {2, 3}, launched  # stages 0 and 1 cannot fit 110 MB
    assert max(mb for s, mb in launched if s == 2) == 5  # 100 MB + 2 MB per sample at the peak
    assert max(mb for s, mb in launched if s == 3) == 8  # 80 MB + 2 MB per sample: 15 fit, 8 is the configured cap
    skipped = [r for r in tuner.rows if r.status == "not launched"]
    assert [r.stage for r in skipped] == [0, 1] and all(r.predicted_peak_bytes > 110 * 10**6 for r in skipped)
    assert (best.stage, best.micro_batch) == (3, 8)  # the highest throughput among what fits
    rows = list(csv.DictReader(open(tmp_path / "res" / "experiments.csv")))
    assert len(rows) == len(tuner.rows) and rows[-1]["predicted_model_state_bytes"]
    assert json.load(open(tmp_path / "res" / "ds_config_optimal.json"))["zero_optimization"]["stage"] == 3


def _train_losses(config: dict | None, steps: int) -> list[float]:
    model = autotune_train.model()
    if config is None:  # plain PyTorch reference
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    else:
        engine, *_ = zero.initialize(model=model, config=config)
    losses = []
    for step in range(steps):
        x, y = autotune_train.batch(step, 2, 0)
        if config is None:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        else:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_crash_and_hang_are_recorded_and_the_best_config_trains(tmp_path):
    at = {"results_dir": str(tmp_path / "res"), "exps_dir": str(tmp_path / "exps"), "start_profile_step": 1,
          "end_profile_step": 2, "max_train_micro_batch_size_per_gpu": 2, "experiment_timeout": 30}  # fmt: skip
    cfg = {**BASE, "zero_optimization": {"stage": [0, 3]}, "autotuning": at}
    path = _write(tmp_path, cfg)
    job = Job(SCRIPT, ["--deepspeed_config", path, "--crash-stage", "0", "--hang-stage", "3"], 1, nproc=1)
    tuner = Autotuner(job, cfg, log=lambda s: None)
    best = tuner.tune()
    status = {(r.stage, r.micro_batch, r.phase): r.status for r in tuner.rows}
    assert status[(0, 2, "confirm")] == "failed" and status[(3, 2, "confirm")] == "timeout", status
    assert "RuntimeError: simulated crash at stage 0" in tuner.rows[1].reason
    assert status[(0, 1, "confirm")] == "ok" and status[(3, 1, "confirm")] == "ok"  # the search went on
    for r in tuner.rows:
        if r.status == "ok" and r.phase != "profile":  # predicted vs measured model states, both recorded
            assert r.throughput > 0 and r.latency_s > 0
            assert (
                abs(r.predicted_model_state_bytes - r.measured_model_state_bytes) <= 0.1 * r.measured_model_state_bytes
            )
    # Both stages' micro-batch 1 were measured again (the recheck round); the best has the higher median.
    medians = {}
    for stage in (0, 3):
        got = [r.metric for r in tuner.rows if r.stage == stage and r.micro_batch == 1 and r.metric is not None]
        assert len(got) == 2, [(r.name, r.phase) for r in tuner.rows]
        medians[stage] = sum(got) / 2
    assert best.status == "ok" and best.stage == max(medians, key=medians.get)
    assert best.metric == pytest.approx(medians[best.stage]) and best.reason == "median of 2 measurement(s)"
    for name in ("experiments.json", "summary.txt", "metric.png", "cmd_optimal.txt"):
        assert (tmp_path / "res" / name).stat().st_size > 0, name
    # The best config file loads and trains: the same losses as plain PyTorch (fp32, stage 0 or 3 on one rank).
    best_cfg = json.load(open(tmp_path / "res" / "ds_config_optimal.json"))
    assert "autotuning" not in best_cfg and "wall_clock_breakdown" not in best_cfg
    best_cfg["train_micro_batch_size_per_gpu"] = 2
    got, want = _train_losses(best_cfg, 4), _train_losses(None, 4)
    assert got == pytest.approx(want, rel=1e-5) and got[-1] < got[0]


def test_zero_run_autotuning_run_tunes_then_trains(tmp_path, capfd):
    from zero.cli import main

    at = {"results_dir": str(tmp_path / "res"), "exps_dir": str(tmp_path / "exps"), "start_profile_step": 1,
          "end_profile_step": 1, "max_train_micro_batch_size_per_gpu": 1}  # fmt: skip
    path = _write(tmp_path, {**BASE, "zero_optimization": {"stage": 1}, "autotuning": at})
    rc = main(["run", "--autotuning", "run", "--nproc-per-node", "1", SCRIPT, "--deepspeed_config", path,
               "--steps", "3"])  # fmt: skip
    out = capfd.readouterr().out
    assert rc == 0, out
    assert "best: z1_mb1" in out and "final loss" in out  # tuned, then trained with the best config
    assert main(["run", "--autotuning", "bogus", SCRIPT]) == 2
