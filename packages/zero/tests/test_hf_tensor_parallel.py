"""The HF Trainer with the AutoTP guide's config runs unchanged on zero: ``"tensor_parallel": {"autotp_size": 2,
"preset_model": "llama"}`` beside ZeRO-1 in the DeepSpeed config given to ``TrainingArguments(deepspeed=...)``,
launched on 2 gloo ranks by ``zero run --as-deepspeed`` (transformers calls ``deepspeed.tp_model_init``, Accelerate
builds its tp mesh and gives both ranks the same samples); in the same launch, the same section beside a ZeRO-3
config. Their per-step losses equal the same Trainer's run without tensor parallelism and without DeepSpeed in one
process (fp32, 1e-5 relative), and what ``save_model`` saves (an
engine checkpoint: the config does not allow a gather) gives through ``zero_to_fp32`` the single-process model, equal
to the engine's gathered weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_launch import plain_reference, zero_run_modes  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_trainer_with_autotp_config_at_zero1_and_zero3_equals_the_run_without(tmp_path):
    runs = zero_run_modes("hf_trainer_tp_job.py", tmp_path, ("tp", "tp3"))
    assert runs["tp"]["saved_worst"] == 0.0
    want = plain_reference("hf_trainer_tp_job", tmp_path)
    assert want["world"] == 1 and sorted(want["losses"], key=int) == [1, 2, 3, 4]
    for mode, run in runs.items():
        assert run["wrapped"] == "zero.engine.engine.Engine" and run["world"] == 2, mode
        assert sorted(map(int, run["losses"])) == [1, 2, 3, 4], mode
        for step, loss in want["losses"].items():
            assert run["losses"][str(step)] == pytest.approx(loss, rel=1e-5), (mode, step)
