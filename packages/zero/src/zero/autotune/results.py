"""What an autotuning session leaves in ``results_dir``.

* ``experiments.csv`` / ``experiments.json``: one row per experiment (see :data:`COLUMNS`): the candidate, its
  status, the metric, predicted vs measured model-state bytes and peak bytes per rank (the maximum over ranks).
* ``ds_config_optimal.json``: the best candidate's config, ready for training (no ``autotuning`` keys left), and
  ``cmd_optimal.txt``: the command that trains with it (DeepSpeed's file names).
* ``summary.txt``: the table :func:`summary_table` prints; ``metric.png``: the metric per experiment.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field

COLUMNS = ("exp", "name", "phase", "stage", "micro_batch", "knobs", "status", "reason", "metric", "latency_s",
           "throughput", "flops_per_gpu", "predicted_model_state_bytes", "measured_model_state_bytes",
           "predicted_peak_bytes", "measured_peak_bytes", "seconds")  # fmt: skip


@dataclass
class Row:
    """One experiment. ``metric`` is the configured metric's value (None when it failed); bytes are per rank."""

    exp: int
    name: str
    phase: str
    stage: int
    micro_batch: int
    knobs: dict = field(default_factory=dict)
    status: str = ""
    reason: str = ""
    metric: float | None = None
    latency_s: float | None = None
    throughput: float | None = None
    flops_per_gpu: float | None = None
    predicted_model_state_bytes: int | None = None
    measured_model_state_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    measured_peak_bytes: int | None = None
    seconds: float = 0.0


def write_rows(results_dir: str, rows: list[Row]) -> None:
    """(Re)write ``experiments.csv`` and ``experiments.json`` (called after each experiment: a crash of the
    tuner itself keeps what was measured)."""
    os.makedirs(results_dir, exist_ok=True)
    data = [asdict(r) for r in rows]
    _atomic(os.path.join(results_dir, "experiments.json"), json.dumps(data, indent=2))
    tmp = os.path.join(results_dir, "experiments.csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for d in data:
            writer.writerow({**d, "knobs": json.dumps(d["knobs"], sort_keys=True)})
    os.replace(tmp, os.path.join(results_dir, "experiments.csv"))


def write_best(results_dir: str, config: dict, cmd: list[str]) -> str:
    """Write ``ds_config_optimal.json`` (``config`` without its ``autotuning`` section) and ``cmd_optimal.txt``;
    returns the config's path."""
    config = {k: v for k, v in config.items() if k != "autotuning"}
    path = os.path.join(results_dir, "ds_config_optimal.json")
    _atomic(path, json.dumps(config, indent=2))
    _atomic(os.path.join(results_dir, "cmd_optimal.txt"), " ".join(cmd) + "\n")
    return path


def summary_table(rows: list[Row], metric: str, best: Row | None, stop_reason: str, total_s: float) -> str:
    """A markdown table of every experiment, the best one and why the search stopped."""
    mib = lambda b: "" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    lines = [f"| exp | candidate | phase | status | {metric} | model states MiB predicted / measured "
             "| peak MiB predicted / measured | s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        value = "" if r.metric is None else f"{r.metric:.4g}"
        status = r.status if not r.reason else f"{r.status}: {r.reason[:80]}"
        lines.append(f"| {r.exp} | {r.name} | {r.phase} | {status} | {value} | "
                     f"{mib(r.predicted_model_state_bytes)} / {mib(r.measured_model_state_bytes)} | "
                     f"{mib(r.predicted_peak_bytes)} / {mib(r.measured_peak_bytes)} | {r.seconds:.1f} |")  # fmt: skip
    lines.append("")
    note = f", {best.reason}" if best and best.reason else ""
    lines.append(f"best: {best.name} ({metric} {best.metric:.4g}{note})" if best else
                 "best: none (no experiment succeeded)")  # fmt: skip
    lines.append(f"experiments: {len(rows)}, stopped: {stop_reason}, total tuning time {total_s:.1f} s")
    return "\n".join(lines)


def plot_metric(path: str, rows: list[Row], metric: str) -> None:
    """A PNG of the metric per experiment (failed ones marked at zero in red), best so far as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ok = [(r.exp, r.metric) for r in rows if r.metric is not None]
    bad = [r.exp for r in rows if r.metric is None]
    if ok:
        ax.bar([e for e, _ in ok], [m for _, m in ok], color="tab:blue", label=metric)
    if bad:
        ax.scatter(bad, [0] * len(bad), color="tab:red", marker="x", label="failed / timed out", zorder=3)
    ax.set_xlabel("experiment")
    ax.set_ylabel(metric)
    ax.set_title(f"zero autotune: {metric} per experiment")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
