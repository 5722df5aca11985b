"""`zero train` end to end on 2 ranks with a tiny model: trains, falls in loss, writes log, curve, checkpoint;
`--resume` continues from the checkpoint to the new step count."""

import json
import subprocess
import sys


def _train(runs, *extra, timeout=240):
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "64",
           "--runs-dir", str(runs), "--name", "t", *extra]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_train_tiny_then_resume(tmp_path):
    runs = tmp_path / "runs"
    _train(runs, "--steps", "12")
    run = runs / "t"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["world_size"] == 2
    assert summary["val_loss_end"] < summary["val_loss_start"] - 0.5  # random init is ~ln(259) = 5.56
    steps = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert all(len(r["rss_mib_per_rank"]) == 2 and r["tokens_per_s"] > 0 for r in steps)
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoint" / "latest").read_text().strip() == "global_step12"

    _train(runs, "--resume", "--steps", "16")
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 17))  # continued at 13, not restarted
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["steps"] == 16 and resumed["val_loss_start"] == summary["val_loss_start"]

    # The consolidated checkpoint loads with transformers as the class the job trained (the command runs in this
    # process: a third interpreter start-up would add nothing to what is checked).
    from zero.cli import main

    assert main(["consolidate", str(run / "checkpoint"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"
