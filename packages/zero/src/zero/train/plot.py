"""The loss curve of a ``zero train`` run as a PNG (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import json
import os
import pathlib


def validation_points(recs: list[dict], summary: dict | None) -> list[tuple[int, float]]:
    """``(step, validation loss)`` in step order: step 0 and the last step from ``summary`` (``val_loss_start``,
    ``steps``/``val_loss_end``), and every log record carrying ``val_loss`` (``zero train --eval-every``)."""
    summary = summary or {}
    periodic = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
    pts = [(0, summary.get("val_loss_start")), *periodic, (summary.get("steps"), summary.get("val_loss_end"))]
    return [(x, y) for x, y in pts if x is not None and y is not None]


def plot_loss(log_path: pathlib.Path, out_path: pathlib.Path, summary: dict | None = None) -> pathlib.Path:
    """Training loss per step from ``log.jsonl``, plus the validation losses: at the start and end (``summary``)
    and at every step whose record has ``val_loss`` (``zero train --eval-every``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in pathlib.Path(log_path).read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label="train loss", lw=1)
    pts = validation_points(recs, summary)
    if pts:
        ax.plot(*zip(*pts), "o--", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("zero train")
    ax.grid(alpha=0.3)
    ax.legend()
    tmp = out_path.with_name(out_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, out_path)
    return out_path
