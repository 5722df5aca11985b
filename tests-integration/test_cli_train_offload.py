"""`zero train --offload nvme` end to end on 2 ranks with the tiny Llama: loss falls, the swap files live in the run
folder's zero_swap/ while training and are gone after a clean exit; `--nvme-path` without nvme, or a missing one,
is a usage error before any rank starts."""

import json
import subprocess
import sys


def _train(runs, *extra, timeout=300):
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "64",
           "--runs-dir", str(runs), "--name", "t", *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_train_tiny_with_nvme_offload(tmp_path):
    runs = tmp_path / "runs"
    out = _train(runs, "--steps", "10", "--offload", "nvme")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "zero train: optimizer state on NVMe: " in out.stdout  # the bytes, computed before the ranks start
    run = runs / "t"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["val_loss_end"] < summary["val_loss_start"] - 0.3
    settings = json.loads((run / "settings.json").read_text())
    assert settings["config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert not (run / "zero_swap").exists()  # removed by the clean exit


def _refused(capfd, runs, *extra) -> str:
    """``zero train`` in this process (a usage error needs no interpreter of its own); capfd also catches the output
    of anything it would launch. Returns stdout + stderr after asserting the exit code is non-zero."""
    from zero.cli import main

    code = main(["train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len", "64", "--runs-dir", str(runs),
                 "--name", "t", *extra])  # fmt: skip
    captured = capfd.readouterr()
    assert code != 0, captured.out[-3000:] + captured.err[-3000:]
    return captured.err + captured.out


def test_nvme_path_without_nvme_is_a_usage_error(tmp_path, capfd):
    text = _refused(capfd, tmp_path / "runs", "--steps", "2", "--offload", "cpu", "--nvme-path", str(tmp_path))
    assert "--nvme-path needs --offload nvme" in text
    assert not (tmp_path / "runs" / "t").exists()


def test_nvme_path_checked_before_any_rank_starts(tmp_path, capfd):
    missing = tmp_path / "no-such-disk"
    text = _refused(capfd, tmp_path / "runs", "--steps", "2", "--offload", "nvme", "--nvme-path", str(missing))
    assert f"nvme_path='{missing}' does not exist" in text, text[-2000:]
    assert "torchrun" not in text and not (tmp_path / "runs" / "t").exists()  # nothing launched, nothing written


def test_big_model_job_config_on_the_tiny_model(tmp_path):
    """The big-model job's config (parameters and optimizer state on NVMe, streamed gradients, the model built on
    the meta device) on 2 ranks: trains, both swap folders live under --nvme-path and are removed, no checkpoint."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "packages" / "zero-offload" / "examples" / "llama_nvme_big.json"
    runs, swap = tmp_path / "runs", tmp_path / "swap"
    swap.mkdir()
    out = _train(runs, "--steps", "10", "--offload", "nvme", "--nvme-path", str(swap), "--config", str(config),
                 "--no-checkpoint", "--nproc-per-node", "2", "--eval-every", "0", "--val-windows", "4")  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = runs / "t"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["val_loss_end"] < summary["val_loss_start"]
    zo = json.loads((run / "settings.json").read_text())["config"]["zero_optimization"]
    assert zo["offload_param"]["nvme_path"] == zo["offload_optimizer"]["nvme_path"] == str(swap)  # --nvme-path
    assert not (run / "checkpoint").exists() and not (swap / "zero_swap").exists()
