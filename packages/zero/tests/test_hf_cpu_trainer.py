"""A Trainer script with a DeepSpeed config on a machine without CUDA, launched on 2 ranks by ``zero run
--as-deepspeed``: without ``use_cpu=True`` the Trainer counts one process and the batch-size error says so and
names the fix; with it the run trains on zero's engine and equals the Trainer's own CPU DDP run (fp32, 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero.compat import alias

JOBS = Path(__file__).resolve().parent / "jobs"
LAUNCH_TIMEOUT = 300  # seconds per launch; one takes about 20-70 s on a busy 2-core machine
pytestmark = pytest.mark.timeout(1200)


def _launch(out: Path, modes: str, as_deepspeed: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "import sys; from zero.cli import main; sys.exit(main(sys.argv[1:]))", "run"]
    cmd += ["--as-deepspeed"] if as_deepspeed else []
    cmd += ["--standalone", "--nproc-per-node", "2", str(JOBS / "hf_trainer_cpu_job.py"), str(out), modes]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    env.pop(alias.ENV_DIR, None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env)


def test_trainer_without_cuda_error_names_use_cpu_and_use_cpu_equals_ddp(tmp_path):
    plain = _launch(tmp_path, "plain", as_deepspeed=True)
    text = plain.stdout + plain.stderr
    assert plain.returncode != 0 and "batch sizes do not multiply out" in text, text[-4000:]
    assert "filled for one process" in text and "use_cpu=True" in text and 'PartialState(backend="gloo")' in text

    # the DDP reference first, then use_cpu, in one launch (jobs/job_modes.py)
    run = _launch(tmp_path, "ddp,use_cpu", as_deepspeed=True)
    assert run.returncode == 0, f"ddp,use_cpu:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    zero_run, ddp = (json.loads((tmp_path / f"{mode}.json").read_text()) for mode in ("use_cpu", "ddp"))
    assert zero_run["deepspeed"] and zero_run["wrapped"] == "zero.engine.engine.Engine" and zero_run["world"] == 2
    assert not ddp["deepspeed"] and ddp["world"] == 2
    assert sorted(ddp["losses"], key=int) == ["1", "2", "3", "4"] and set(zero_run["losses"]) == set(ddp["losses"])
    for step, loss in ddp["losses"].items():
        assert zero_run["losses"][step] == pytest.approx(loss, rel=1e-5), step
