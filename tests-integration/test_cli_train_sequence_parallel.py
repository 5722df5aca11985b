"""`zero train --sequence-parallel N`: the main job's Llama (tiny) trained with Ulysses sequence parallelism, 2 ranks
sharing each window (sp 2 x dp 1), 3 steps of ZeRO-3, equals the same job on 1 rank without sequence parallelism
(the same windows): per-step training losses and the final validation loss within 1e-5 relative (fp32; the two
differ only in summation order). Bad sizes are refused before a run folder exists."""

import json
import subprocess
import sys

import pytest


def _train(runs, name: str, nproc: int, sp: int) -> list[dict]:
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "32",
           "--runs-dir", str(runs), "--name", name, "--steps", "3", "--eval-every", "0", "--val-windows", "8",
           "--no-checkpoint", "--nproc-per-node", str(nproc), "--sequence-parallel", str(sp)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    banner = (
        f"{nproc} ranks (sequence parallel {sp}: each sequence shared by {sp} ranks)," if sp > 1 else f"{nproc} ranks,"
    )
    assert banner in out.stdout, out.stdout[:500]  # the run says how it splits the work
    run = runs / name
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()], json.loads(
        (run / "summary.json").read_text()
    )


def test_sequence_parallel_training_equals_the_run_without(tmp_path):
    runs = tmp_path / "runs"
    sp_log, sp_summary = _train(runs, "sp2", 2, 2)
    log, summary = _train(runs, "sp1", 1, 1)
    assert sp_summary["world_size"] == 2 and summary["world_size"] == 1
    assert [r["step"] for r in sp_log] == [r["step"] for r in log] == [1, 2, 3]
    for got, want in zip(sp_log, log):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got["step"], got["loss"], want["loss"])
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), got["step"]
    assert sp_summary["val_loss_end"] == pytest.approx(summary["val_loss_end"], rel=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sequence-parallel", "3"], "--sequence-parallel 3 must divide the ranks (--nproc-per-node 2)"),
        (["--sequence-parallel", "2", "--seq-len", "33"], "--sequence-parallel 2 must divide --seq-len 33"),
        (["--sequence-parallel", "0"], "--sequence-parallel must be >= 1, got 0"),
    ],
)
def test_bad_sequence_parallel_sizes_are_usage_errors(tmp_path, capsys, extra, message):
    from zero.cli import main

    code = main(["train", "--runs-dir", str(tmp_path / "runs"), "--model-size", "tiny", *extra])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
