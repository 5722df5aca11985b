"""`zero train --eval-every N`: validation loss every N steps on every rank, logged in log.jsonl and plotted as a
line of many points (it used to be two points, start and end)."""

import json
import math
import subprocess
import sys

from zero.train.plot import validation_points


def test_train_evaluates_every_n_steps_logs_and_plots(tmp_path):
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "64",
           "--runs-dir", str(runs), "--name", "v", "--steps", "6", "--eval-every", "2",
           "--val-windows", "8"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = runs / "v"
    recs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    logged = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    assert sorted(logged) == [2, 4]  # the last step's evaluation is the summary's val_loss_end
    assert all(math.isfinite(v) and 0 < v < 7 for v in logged.values())
    points = validation_points(recs, summary)
    assert [x for x, _ in points] == [0, 2, 4, 6]
    assert points[0][1] == summary["val_loss_start"] and points[-1][1] == summary["val_loss_end"]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 2: validation loss" in out.stderr + out.stdout


def test_eval_every_negative_is_a_usage_error(tmp_path, capsys):
    from zero.cli import main

    code = main(["train", "--runs-dir", str(tmp_path / "runs"), "--eval-every", "-1"])
    assert code == 2 and "--eval-every must be >= 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
