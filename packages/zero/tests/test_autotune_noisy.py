"""The search on a known noisy objective, through the whole session (profile, memory model, confirmations, search,
recheck) with a fake experiment runner: every launch returns the objective's throughput times seeded log-normal
noise of 12% (a short run on the shared machine). The model-based tuner's pick must be within 5% of the true
optimum with at most a third of the grid's experiments, in at least 90% of 20 independent noise draws (the grid's
own pick, the luckiest single sample of 24, is within 5% in 13 of the same 20; the session 19)."""

import json
import math
import os
import random

import pytest

import zero.autotune.autotuner as autotuner_mod
from zero.autotune import Autotuner, Job
from zero.autotune.choice import choose, relative_noise
from zero.autotune.experiment import Outcome

NOISE = 0.12
SPACE = {"stage": [0, 1, 2, 3], "overlap_comm": [True, False], "reduce_bucket_size": [700_000, 500_000_000],
         "stage3_unit_numel": [1_000_000, 4_000_000]}  # fmt: skip


def true_throughput(zo: dict, mb: int) -> float:
    """Samples/s: a larger micro-batch pays, stages cost more the higher, overlap hurts at stage 2 (two cores),
    small buckets help at 0-2, larger units help at 3. The optimum: stage 0, micro-batch 4, small buckets."""
    stage = zo["stage"]
    value = {0: 1.0, 1: 0.96, 2: 0.88, 3: 0.84}[stage] * (1.25 if mb == 4 else 1.0)
    if stage < 3:
        value *= 1.04 if zo.get("reduce_bucket_size") == 700_000 else 1.0
    if stage == 2 and zo.get("overlap_comm"):
        value *= 0.9
    if stage == 3:
        value *= (0.95 if zo.get("overlap_comm") else 1.0) * (1.08 if zo.get("stage3_unit_numel") == 4_000_000 else 1)
    return value


def fake_runner(seed: int):
    rng = random.Random(seed)

    def run(cmd, exp_dir, timeout, env=None):
        cfg = json.load(open(cmd[cmd.index("--deepspeed_config") + 1]))
        if "profile" in exp_dir:
            info = {"num_params": 10**6, "param_numels": [10**6], "activation_bytes": 10**5,
                    "activation_bytes_per_sample": 1e5, "optimizer_bytes": 8 * 10**6,
                    "model_state_bytes": 16 * 10**6, "peak_bytes": 17 * 10**6}  # fmt: skip
            json.dump(info, open(os.path.join(exp_dir, "metrics.json"), "w"))
            return Outcome("ok", info)
        mb = cfg["train_micro_batch_size_per_gpu"]
        throughput = true_throughput(cfg["zero_optimization"], mb) * math.exp(rng.gauss(0.0, NOISE))
        return Outcome("ok", {"latency": 2 * mb / throughput, "throughput": throughput,
                              "model_state_bytes": 1, "peak_bytes": 2})  # fmt: skip

    return run


def session(tmp_path, monkeypatch, tuner: str, trials: int, seed: int, recheck: int = 2) -> Autotuner:
    monkeypatch.setattr(autotuner_mod, "run_experiment", fake_runner(seed))
    out = tmp_path / f"{tuner}{seed}"
    at = {"fast": True, "tuner_type": tuner, "tuner_num_trials": trials, "tuner_early_stopping": 100,
          "max_train_micro_batch_size_per_gpu": 4, "num_tuning_micro_batch_sizes": 2,
          "memory_per_rank": 10**9, "tuner_recheck_top_k": recheck,
          "results_dir": str(out / "res"), "exps_dir": str(out / "exps")}  # fmt: skip
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": dict(SPACE), "autotuning": at}  # fmt: skip
    job = Job("train.py", ["--deepspeed_config", "ds.json"], 1, nproc=2)
    tuner_obj = Autotuner(job, cfg, log=lambda s: None)
    tuner_obj.tune()
    return tuner_obj


def picked_value(t: Autotuner) -> float:
    return true_throughput(t.best_config["zero_optimization"], t.best_config["train_micro_batch_size_per_gpu"])


OPTIMUM = true_throughput({"stage": 0, "reduce_bucket_size": 700_000}, 4)


def launches(t: Autotuner) -> int:
    return sum(r.phase in ("confirm", "tune", "recheck") for r in t.rows)


def test_model_based_is_within_5_percent_in_a_third_of_the_grid(tmp_path, monkeypatch):
    grid = session(tmp_path, monkeypatch, "gridsearch", 1000, 0, recheck=0)
    assert launches(grid) == 24  # stages 0-3 x micro-batch {2, 4} x the stage's knobs, each once
    budget = launches(grid) // 3
    ratios = []
    for seed in range(SEEDS):  # independent noise streams: a claim about the method, not one lucky draw
        mb = session(tmp_path, monkeypatch, "model_based", budget - 4, seed)  # the 4 stage confirmations count
        assert launches(mb) <= budget and sum(r.phase == "recheck" for r in mb.rows) == 2
        ratios.append(picked_value(mb) / OPTIMUM)
    # 12% noise per run against 4% gaps between the top configurations: no method with 8 runs is always right;
    # the session must be within 5% in at least 90% of the draws and never pick a stage 2-3 config (<= 0.88).
    assert sum(r >= 0.95 for r in ratios) >= 0.9 * SEEDS and min(ratios) > 0.88, ratios


SEEDS = 20


def test_choice_medians_noise_and_ties():
    # b's single lucky sample is the highest, but a (measured 3 times) is ahead on medians within noise: a ties
    # with b and wins by being measured more often; c is far below and never ties.
    samples = {"a": [10.2, 10.6, 9.8], "b": [10.5], "c": [5.0, 5.2]}
    noise = relative_noise(samples)  # pooled relative standard deviation of a's and c's repeats
    assert noise == pytest.approx(math.sqrt(((0.4 / 10.2) ** 2 + (math.sqrt(0.02) / 5.1) ** 2) / 2), rel=1e-6)
    assert choose(samples) == "a"
    # Beyond the noise band the higher median wins even against more measurements.
    assert choose({"x": [8.0, 8.1, 7.9], "y": [10.2, 10.3]}) == "y"
    assert choose({"x": [8.0, 8.1, 7.9], "y": [10.2, 10.3]}, estimates={"x": 9.0, "y": 8.0}) == "x"
    assert choose({"x": []}) is None
