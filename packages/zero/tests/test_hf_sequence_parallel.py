"""The HF Trainer with Accelerate's DeepSpeed sequence parallelism runs unchanged on zero: ``TrainingArguments(
parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(
...)))`` with a ZeRO-3 DeepSpeed config, launched on 2 gloo ranks by ``zero run --as-deepspeed`` (a tiny Llama built
from a config, each rank half of every sequence). Its per-step losses equal the same Trainer's run without sequence
parallelism and without DeepSpeed in one process (fp32, 1e-5 relative)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_launch import plain_reference, zero_run_modes  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_trainer_with_deepspeed_sequence_parallelism_equals_the_run_without(tmp_path):
    sp = zero_run_modes("hf_trainer_sp_job.py", tmp_path, ("sp",))["sp"]
    assert sp["wrapped"] == "zero.engine.engine.Engine" and sp["world"] == 2
    want = plain_reference("hf_trainer_sp_job", tmp_path)
    assert want["world"] == 1 and sorted(want["losses"], key=int) == [1, 2, 3, 4]
    assert sorted(map(int, sp["losses"])) == [1, 2, 3, 4]
    for step, loss in want["losses"].items():
        assert sp["losses"][str(step)] == pytest.approx(loss, rel=1e-5), step
