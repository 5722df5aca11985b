"""`zero train --pipeline-parallel N`: the main job's Llama (tiny) cut into 2 pipeline stages by the Hugging Face
split (2 ranks, pp 2 x dp 1, ZeRO-1 by default), 3 steps, equals the same job on 1 rank without pipeline
parallelism (ZeRO-3, the same windows): per-step training losses, gradient norms (over both stages) and the final
validation loss within 1e-5 relative (fp32; the two differ in summation order). The run's checkpoint is a
pipeline checkpoint whose ``zero_to_fp32`` gives the whole model. Bad sizes are refused before a run folder
exists."""

import json
import subprocess
import sys

import pytest


def _train(runs, name: str, nproc: int, pp: int) -> tuple[list[dict], dict, str]:
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "32",
           "--runs-dir", str(runs), "--name", name, "--steps", "3", "--eval-every", "0", "--val-windows", "8",
           "--nproc-per-node", str(nproc), "--pipeline-parallel", str(pp)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = runs / name
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return log, json.loads((run / "summary.json").read_text()), out.stdout


def test_pipeline_training_equals_the_run_without(tmp_path):
    from zero.checkpoint_tools.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    runs = tmp_path / "runs"
    pp_log, pp_summary, stdout = _train(runs, "pp2", 2, 2)
    assert "2 ranks (pipeline parallel 2: 2 stages x 1 data-parallel replicas)" in stdout, stdout[:500]
    log, summary, _ = _train(runs, "pp1", 1, 1)
    assert [r["step"] for r in pp_log] == [r["step"] for r in log] == [1, 2, 3]
    for got, want in zip(pp_log, log):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got["step"], got["loss"], want["loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), got["step"]
    assert pp_summary["val_loss_end"] == pytest.approx(summary["val_loss_end"], rel=1e-5)
    whole = get_fp32_state_dict_from_zero_checkpoint(runs / "pp2" / "checkpoint")
    plain = get_fp32_state_dict_from_zero_checkpoint(runs / "pp1" / "checkpoint")
    assert len(whole) == len(plain)  # every layer once: embedding, 2 decoder layers, norm, head
    assert sum(t.numel() for t in whole.values()) == sum(t.numel() for t in plain.values())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--pipeline-parallel", "3"], "--pipeline-parallel 3 must divide the ranks (--nproc-per-node 2)"),
        (["--pipeline-parallel", "0"], "--pipeline-parallel must be >= 1, got 0"),
        (["--pipeline-parallel", "2", "--sequence-parallel", "2"], "cannot be combined"),
    ],
)
def test_bad_pipeline_sizes_are_usage_errors(tmp_path, capsys, extra, message):
    from zero.cli import main

    code = main(["train", "--runs-dir", str(tmp_path / "runs"), "--model-size", "tiny", *extra])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
