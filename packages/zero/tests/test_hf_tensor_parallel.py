"""The HF Trainer with the AutoTP guide's config runs unchanged on zero: ``"tensor_parallel": {"autotp_size": 2,
"preset_model": "llama"}`` beside ZeRO-1 in the DeepSpeed config given to ``TrainingArguments(deepspeed=...)``,
launched on 2 gloo ranks by ``zero run --as-deepspeed`` (transformers calls ``deepspeed.tp_model_init``, Accelerate
builds its tp mesh and gives both ranks the same samples). Its per-step losses equal the same Trainer's run without
tensor parallelism and without DeepSpeed in one process (fp32, 1e-5 relative), and what ``save_model`` saves (an
engine checkpoint: the config does not allow a gather) gives through ``zero_to_fp32`` the single-process model, equal
to the engine's gathered weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zero.compat import alias

JOBS = Path(__file__).resolve().parent / "jobs"
LAUNCH_TIMEOUT = 300  # seconds; the launch takes about 20-70 s on a busy 2-core machine
pytestmark = pytest.mark.timeout(600)


def _plain_reference(out: Path) -> dict:
    """The Trainer in this process, no DeepSpeed, no tensor parallelism (its Accelerate state reset after)."""
    from accelerate.state import AcceleratorState, PartialState

    sys.path.insert(0, str(JOBS))
    try:
        from hf_trainer_tp_job import train

        return train(str(out), "plain")
    finally:
        sys.path.remove(str(JOBS))
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()


def test_trainer_with_autotp_config_equals_the_run_without(tmp_path):
    cmd = [sys.executable, "-c", "import sys; from zero.cli import main; sys.exit(main(sys.argv[1:]))", "run",
           "--as-deepspeed", "--standalone", "--nproc-per-node", "2", str(JOBS / "hf_trainer_tp_job.py"),
           str(tmp_path), "tp"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    env.pop(alias.ENV_DIR, None)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=env)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-6000:]}"
    tp = json.loads((tmp_path / "tp.json").read_text())
    assert tp["wrapped"] == "zero.engine.engine.Engine" and tp["world"] == 2
    assert tp["saved_worst"] == 0.0
    want = _plain_reference(tmp_path)
    assert want["world"] == 1 and sorted(want["losses"], key=int) == [1, 2, 3, 4]
    assert sorted(map(int, tp["losses"])) == [1, 2, 3, 4]
    for step, loss in want["losses"].items():
        assert tp["losses"][str(step)] == pytest.approx(loss, rel=1e-5), step
