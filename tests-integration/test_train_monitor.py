"""`zero train --monitor csv_monitor,tensorboard`: the main job writes DeepSpeed's events under <run>/monitors, one
row per optimizer step at x = samples (2 ranks x micro-batch 4 per step); a bad name is a one-line error."""

import csv
import subprocess
import sys


def _train(runs, *extra):
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "64",
           "--runs-dir", str(runs), "--name", "m", "--steps", "3", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_train_monitor_flag_writes_events(tmp_path):
    out = _train(tmp_path, "--monitor", "csv_monitor,tensorboard")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    csv_dir = tmp_path / "m" / "monitors" / "csv_monitor"
    rows = list(csv.reader(open(csv_dir / "Train_Samples_train_loss.csv")))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [8, 16, 24]
    assert all(0 < float(r[1]) < 7 for r in rows[1:])  # byte-level LM: ~ln(259) = 5.56 at the start
    lr = [float(r[1]) for r in list(csv.reader(open(csv_dir / "Train_Samples_lr.csv")))[1:]]
    assert len(lr) == 3 and min(lr) >= 0 and max(lr) > 0  # the warm-up schedule, as get_lr() after each step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "m" / "monitors" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("Train/Samples/train_loss")] == [8, 16, 24]


def test_train_monitor_unknown_name_is_a_usage_error(tmp_path, capsys):
    from zero.cli import main

    argv = ["train", "--model-size", "tiny", "--runs-dir", str(tmp_path), "--name", "m", "--monitor", "tensorbord"]
    assert main(argv) == 2
    assert "--monitor: 'tensorbord' is not one of" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
