"""`zero train --resume auto` starts a run when there is nothing to continue and continues it when there is;
`--checkpoint-every-steps` writes the intermediate checkpoints a restarted rank resumes from."""

import json
import subprocess
import sys


def _train(runs, *extra, timeout=400):
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "0.2", "--seq-len", "32",
           "--val-windows", "4", "--runs-dir", str(runs), "--name", "r", "--resume", "auto", *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_resume_auto_and_checkpoint_interval(tmp_path):
    runs = tmp_path / "runs"
    _train(runs, "--steps", "4", "--checkpoint-every-steps", "2", "--max-restarts", "1")
    run = runs / "r"
    assert sorted(p.name for p in (run / "checkpoint").glob("global_step*")) == ["global_step2", "global_step4"]
    assert json.loads((run / "settings.json").read_text())["checkpoint_every_steps"] == 2

    _train(runs, "--steps", "6")
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))  # continued at 5
    assert (run / "checkpoint" / "latest").read_text().strip() == "global_step6"
    assert (run / "checkpoint" / "global_step4").is_dir()  # the interval is kept by the resumed run: 6 = last
