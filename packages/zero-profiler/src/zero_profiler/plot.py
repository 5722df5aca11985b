"""``plot_run``: the step-time breakdown (stacked areas) and the loss curve of a run log, to PNG.

matplotlib is an optional extra (``pip install 'zero-profiler[plot]'``), imported only when plotting; the Agg
canvas is used directly, so no global pyplot state or display is touched.
"""

from __future__ import annotations

import importlib
import os
import pathlib
from collections.abc import Iterable, Mapping

from zero_profiler.run_log import RunRecord, load_run_log


def _matplotlib():
    try:
        figure = importlib.import_module("matplotlib.figure")
        agg = importlib.import_module("matplotlib.backends.backend_agg")
    except ImportError as e:
        raise ImportError("plot_run needs matplotlib: pip install 'zero-profiler[plot]' (matplotlib>=3.7)") from e
    return figure.Figure, agg.FigureCanvasAgg


def phase_series(records: list[RunRecord]) -> tuple[list[int], dict[str, list[float]]]:
    """(steps, {phase: seconds per step}) with phases in order of first appearance and 0 where a step lacks one."""
    phases: list[str] = []
    for r in records:
        phases += [p for p in r.seconds if p not in phases]
    return [r.step for r in records], {p: [r.seconds.get(p, 0.0) for r in records] for p in phases}


def plot_run(
    run_log: str | os.PathLike | Iterable[Mapping],
    out_png: str | os.PathLike,
    *,
    title: str | None = None,
    dpi: int = 100,
) -> pathlib.Path:
    """Draw ``run_log`` (a path or the records; schema in :mod:`zero_profiler.run_log`) to ``out_png``.

    Top panel: seconds per step, one stacked area per phase; bottom panel: loss per step (``null`` losses are
    left out). Returns the PNG's path. Raises ``ValueError`` for a malformed log (see ``load_run_log``) and
    ``ImportError`` naming the extra when matplotlib is absent.
    """
    records = load_run_log(run_log)
    Figure, FigureCanvasAgg = _matplotlib()
    steps, series = phase_series(records)
    fig = Figure(figsize=(9, 6.5), dpi=dpi)
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    if series:
        top.stackplot(steps, *series.values(), labels=list(series), alpha=0.85)
        top.legend(loc="upper right", fontsize="small", ncols=min(4, len(series)))
    top.set_ylabel("seconds per step")
    top.set_title(title or "step-time breakdown")
    top.grid(alpha=0.3)
    losses = [(r.step, r.loss) for r in records if r.loss is not None]
    if losses:
        marker = "." if len(losses) < 50 else None
        bottom.plot([s for s, _ in losses], [v for _, v in losses], color="tab:red", marker=marker)
    bottom.set_xlabel("step")
    bottom.set_ylabel("loss")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    out = pathlib.Path(out_png)
    fig.savefig(out, format="png")
    return out
