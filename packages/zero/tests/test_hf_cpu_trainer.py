"""A Trainer script with a DeepSpeed config on a machine without CUDA, launched on 2 ranks by ``zero run
--as-deepspeed``: without ``use_cpu=True`` the Trainer counts one process and the batch-size error says so and
names the fix; with it the run trains on zero's engine and equals the Trainer's own CPU DDP run (fp32, 1e-5).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_launch import zero_run, zero_run_modes  # noqa: E402

pytestmark = pytest.mark.timeout(1200)


def test_trainer_without_cuda_error_names_use_cpu_and_use_cpu_equals_ddp(tmp_path):
    plain = zero_run("hf_trainer_cpu_job.py", tmp_path, "plain")
    text = plain.stdout + plain.stderr
    assert plain.returncode != 0 and "batch sizes do not multiply out" in text, text[-4000:]
    assert "filled for one process" in text and "use_cpu=True" in text and 'PartialState(backend="gloo")' in text

    # the DDP reference first, then use_cpu, in one launch (jobs/job_modes.py)
    runs = zero_run_modes("hf_trainer_cpu_job.py", tmp_path, ("ddp", "use_cpu"))
    engine_run, ddp = runs["use_cpu"], runs["ddp"]
    assert engine_run["deepspeed"] and engine_run["wrapped"] == "zero.engine.engine.Engine" and engine_run["world"] == 2
    assert not ddp["deepspeed"] and ddp["world"] == 2
    assert sorted(ddp["losses"], key=int) == ["1", "2", "3", "4"] and set(engine_run["losses"]) == set(ddp["losses"])
    for step, loss in ddp["losses"].items():
        assert engine_run["losses"][step] == pytest.approx(loss, rel=1e-5), step
