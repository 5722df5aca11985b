"""`zero train` end to end on 2 ranks with a tiny Llama (ZeRO-3, the job's defaults), one launch shared by the tests
below: `--resume auto` with nothing to continue (so it starts), 12 steps with a checkpoint every 4 and a restart
allowed (`--checkpoint-every-steps 4 --max-restarts 1`), validation every 4 steps, DeepSpeed's monitors
(`--monitor csv_monitor,tensorboard`) and the observing config keys (`flops_profiler`, `wall_clock_breakdown`,
`comms_logger`); then `--resume auto` again, which continues it to 16 steps.

Each test checks one of what that run must do: fall in loss and write its log, curve and checkpoints, then continue
from the last checkpoint, and `zero consolidate` what it saved into a folder transformers loads; evaluate every N
steps and plot the points; write the monitors' events at x = samples; print the FLOPs table, the time breakdown and
the collectives at `steps_per_print`, and record seconds per phase for `zero plot`.
"""

import copy
import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest

SEQ, MICRO, STEPS, EVAL_EVERY, RESUMED_STEPS = 64, 4, 12, 4, 16
CHECKPOINT_EVERY = 4


def _train(runs, cfg_path, tmp, *extra, timeout=300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "zero.cli", "train", "--model-size", "tiny", "--max-data-mb", "1", "--seq-len",
           str(SEQ), "--runs-dir", str(runs), "--name", "t", "--config", str(cfg_path), *extra]  # fmt: skip
    env = dict(os.environ, TMPDIR=str(tmp))  # what the job leaves in the temporary folder: nothing (checked)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


class _Run:
    """The shared run: its folder, first launch's output and files read before the resume rewrote them."""

    def __init__(self, folder, tmp, out, records, summary, checkpoints, resumed_records, resumed_summary, left):
        self.folder = folder  # <runs>/t
        self.tmp = tmp  # a scratch folder of the module
        self.out = out  # the first launch's CompletedProcess
        self.records = records  # log.jsonl after the first launch
        self.summary = summary  # summary.json after the first launch
        self.checkpoints = checkpoints  # the checkpoint folder's tags after the first launch
        self.resumed_records = resumed_records  # log.jsonl after --resume
        self.resumed_summary = resumed_summary  # summary.json after --resume
        self.left = left  # what both launches left in their temporary folder (TMPDIR)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> _Run:
    from zero.commands.train import DEFAULT_CONFIG

    tmp = tmp_path_factory.mktemp("cli_train")
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    cfg.update(wall_clock_breakdown=True, steps_per_print=2, comms_logger={"enabled": True},
               flops_profiler={"enabled": True, "profile_step": 2, "detailed": False,
                               "output_file": str(tmp / "flops.json")})  # fmt: skip
    cfg_path = tmp / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    runs = tmp / "runs"
    job_tmp = tmp / "job_tmp"
    job_tmp.mkdir()
    common = ["--resume", "auto", "--eval-every", str(EVAL_EVERY), "--val-windows", "8", "--monitor",
              "csv_monitor,tensorboard"]  # fmt: skip
    out = _train(runs, cfg_path, job_tmp, "--steps", str(STEPS), "--checkpoint-every-steps", str(CHECKPOINT_EVERY),
                 "--max-restarts", "1", *common)  # fmt: skip
    folder = runs / "t"

    def read():
        records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]
        return records, json.loads((folder / "summary.json").read_text())

    records, summary = read()
    (tmp / "loss_first.png").write_bytes((folder / "loss.png").read_bytes())
    checkpoints = sorted(p.name for p in (folder / "checkpoint").glob("global_step*"))
    assert (folder / "checkpoint" / "latest").read_text().strip() == f"global_step{STEPS}"
    _train(runs, cfg_path, job_tmp, "--steps", str(RESUMED_STEPS), *common)
    left = sorted(p.name for p in job_tmp.iterdir())
    return _Run(folder, tmp, out, records, summary, checkpoints, *read(), left)


def test_trains_falls_in_loss_writes_log_curve_checkpoints(run):
    assert run.summary["steps"] == STEPS and run.summary["world_size"] == 2
    assert run.checkpoints == sorted(f"global_step{s}" for s in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    assert json.loads((run.folder / "settings.json").read_text())["checkpoint_every_steps"] == CHECKPOINT_EVERY
    assert run.summary["val_loss_end"] < run.summary["val_loss_start"] - 0.5  # random init is ~ln(259) = 5.56
    assert [r["step"] for r in run.records] == list(range(1, STEPS + 1))
    assert all(len(r["rss_mib_per_rank"]) == 2 and r["tokens_per_s"] > 0 for r in run.records)
    assert (run.tmp / "loss_first.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_job_leaves_nothing_in_the_temporary_folder(run):
    # torchrun's own log folder (torchelastic_*) was left behind by every launch; torch's compile cache
    # (torchinductor_<user>) is a cache shared across processes by design, not a leftover
    assert [name for name in run.left if not name.startswith("torchinductor_")] == []


def test_resume_auto_continues_from_the_last_checkpoint_and_consolidates_for_transformers(run, tmp_path):
    assert [r["step"] for r in run.resumed_records] == list(range(1, RESUMED_STEPS + 1))  # continued, not restarted
    assert run.resumed_records[:STEPS] == run.records  # the first run's records kept as they were
    assert run.resumed_summary["steps"] == RESUMED_STEPS
    assert run.resumed_summary["val_loss_start"] == run.summary["val_loss_start"]
    assert (run.folder / "checkpoint" / "latest").read_text().strip() == f"global_step{RESUMED_STEPS}"
    assert (run.folder / "checkpoint" / f"global_step{CHECKPOINT_EVERY}").is_dir()  # the resumed run keeps the interval

    # The consolidated checkpoint loads with transformers as the class the job trained (the command runs in this
    # process: a third interpreter start-up would add nothing to what is checked).
    from zero.cli import main

    assert main(["consolidate", str(run.folder / "checkpoint"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForCausalLM"


def test_evaluates_every_n_steps_logs_and_plots(run):
    from zero.train.plot import validation_points

    logged = {r["step"]: r["val_loss"] for r in run.records if "val_loss" in r}
    assert sorted(logged) == list(range(EVAL_EVERY, STEPS, EVAL_EVERY))  # the last step's is the summary's end
    assert all(math.isfinite(v) and 0 < v < 7 for v in logged.values())
    points = validation_points(run.records, run.summary)
    assert [x for x, _ in points] == list(range(0, STEPS + 1, EVAL_EVERY))
    assert points[0][1] == run.summary["val_loss_start"] and points[-1][1] == run.summary["val_loss_end"]
    assert f"step {EVAL_EVERY}: validation loss" in run.out.stderr + run.out.stdout


def test_monitors_write_events_at_samples(run):
    samples = [2 * MICRO * s for s in range(1, RESUMED_STEPS + 1)]  # 2 ranks x micro-batch 4 per step
    csv_dir = run.folder / "monitors" / "csv_monitor"
    rows = list(csv.reader(open(csv_dir / "Train_Samples_train_loss.csv")))
    # each launch writes the header before its first row (DeepSpeed's csv monitor: once per process); the resume
    # appends after the first launch's rows
    header = ["step", "train_loss"]
    assert rows[0] == header and rows[STEPS + 1] == header and rows.count(header) == 2
    rows = [r for r in rows if r != header]
    assert [int(r[0]) for r in rows] == samples
    assert all(0 < float(r[1]) < 7 for r in rows)  # byte-level LM: ~ln(259) = 5.56 at the start
    lr = [float(r[1]) for r in csv.reader(open(csv_dir / "Train_Samples_lr.csv")) if r[0] != "step"]
    assert len(lr) == RESUMED_STEPS and min(lr) >= 0 and max(lr) > 0  # the warm-up schedule, get_lr() after a step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.folder / "monitors" / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("Train/Samples/train_loss")] == samples


def test_observers_print_at_steps_per_print_and_zero_plot_draws_the_log(run, tmp_path):
    from zero.train.model import build_model

    text = run.out.stdout
    # flops_profiler: one table, for step 2, whose per-token ratio is the JSON's totals over this rank's tokens.
    assert text.count("zero flops profiler - step 2") == 1
    totals = json.loads((run.tmp / "flops.json").read_text())["totals"]
    assert totals["params"] == sum(p.numel() for p in build_model("tiny", SEQ, 0).parameters())  # not shards
    tokens = MICRO * SEQ  # gradient_accumulation_steps 1: one micro-batch of MICRO windows of SEQ tokens per rank
    per_token = (totals["forward"]["flops"] + totals["backward"]["flops"]) / tokens
    m = re.search(rf"over {tokens} tokens = ([0-9.]+) x \(6 x non-embedding params\)", text)
    assert m is not None, text[-3000:]
    assert float(m.group(1)) == round(per_token / (6 * totals["non_embedding_params"]), 3)

    # wall_clock_breakdown and comms_logger print at every steps_per_print (2) step, from rank 0 only.
    assert text.count("step 2: time per step over the last 2 step(s):") == 1
    assert text.count("time per step over the last 2 step(s):") == STEPS // 2
    assert text.count("step 2: collectives on rank 0") == 1 and "collectives on rank 1" not in text
    assert "| all_gather_into_tensor |" in text and "| reduce_scatter_tensor |" in text

    # Run log: every record has seconds per phase in zero_profiler's schema.
    for r in run.records:
        assert set(r["seconds"]) == {"data", "forward", "backward", "step"}
        assert all(v >= 0 for v in r["seconds"].values()) and r["seconds"]["forward"] > 0
        assert sum(r["seconds"].values()) <= r["step_s"]

    # zero plot: a PNG that decodes to an RGBA image of the requested size.
    import matplotlib.image

    from zero.cli import main

    png = tmp_path / "breakdown.png"  # the command in this process: a second interpreter start-up adds nothing here
    assert main(["plot", str(run.folder / "log.jsonl"), str(png), "--dpi", "50"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape == (325, 450, 4)  # 9 x 6.5 inches at 50 dpi
