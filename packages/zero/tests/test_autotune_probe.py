"""The engine's autotuning probe, in process on one rank: a timed run writes latency/throughput/FLOPS from the
engine's timers and exits after end_profile_step; the model profile counts the activation bytes autograd saves."""

import json
import os
import sys

import pytest
import torch

import zero

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import autotune_train  # noqa: E402

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip


def _train_until_exit(config: dict, steps: int = 10) -> int:
    engine, *_ = zero.initialize(model=autotune_train.model(), config=config)
    done = 0
    with pytest.raises(SystemExit) as exit_info:
        for step in range(steps):
            x, y = autotune_train.batch(step, 4, 0)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            done += 1
    assert exit_info.value.code == 0
    return done


def test_timed_run_writes_metrics_and_exits_after_end_step(tmp_path):
    path = str(tmp_path / "metrics.json")
    flops = {"enabled": True, "profile_step": 2, "output_file": str(tmp_path / "flops.txt")}
    auto = {"enabled": True, "start_profile_step": 2, "end_profile_step": 4, "metric_path": path}
    cfg = {**BASE, "wall_clock_breakdown": True, "flops_profiler": flops, "autotuning": auto}
    assert _train_until_exit(cfg) == 3  # steps 1-3 completed; step 4's boundary wrote the metrics and exited
    m = json.load(open(path))
    assert m["steps"] == 3 and len(m["step_latencies"]) == 3 and all(s > 0 for s in m["step_latencies"])
    assert m["latency"] == pytest.approx(sorted(m["step_latencies"])[1])  # the median step
    assert m["throughput"] == pytest.approx(4 / m["latency"])  # train_batch_size 4 on one rank
    # the profiled step's matmul FLOPs (2 per MAC), 4 samples: forward 32*97 + 97*7 MACs per sample; backward the
    # second Linear's input and weight gradients, the first Linear's weight gradient only (x needs none)
    matmul = 2 * 4 * ((32 * 97 + 97 * 7) + 2 * 97 * 7 + 32 * 97)
    assert matmul <= m["FLOPS_per_gpu"] * m["latency"] < 1.2 * matmul  # + bias, GELU and loss-free pointwise
    assert m["model_state_bytes"] == 16 * (32 * 97 + 97 + 97 * 7 + 7)  # stage 0 fp32 AdamW: 16 bytes/element


def test_model_profile_counts_saved_activations(tmp_path):
    path = str(tmp_path / "model_info.json")
    cfg = {**BASE, "autotuning": {"enabled": True, "model_info": {"profile": True}, "model_info_path": path}}
    assert _train_until_exit(cfg) == 0  # exits at the first boundary
    info = json.load(open(path))
    assert info["num_params"] == 32 * 97 + 97 + 97 * 7 + 7 and info["profiled_samples"] == 4
    # saved for backward per sample: the first Linear's input (32), GELU's input (97), the second Linear's input
    # (97), fp32; the weights are parameters and not counted
    assert info["activation_bytes_per_sample"] == (32 + 97 + 97) * 4
    assert info["optimizer_bytes"] == 8 * info["num_params"]
