"""The run-log schema: one record per optimizer step with its loss and the seconds of each phase.

A run log is a JSON file holding a list of records (the engine may also write JSON Lines, one record per line,
so a killed run keeps every finished step)::

    [
      {"step": 1, "loss": 4.1589, "seconds": {"forward": 0.121, "backward": 0.240, "step": 0.041,
                                              "allgather_wait": 0.012}},
      {"step": 2, "loss": 4.0312, "seconds": {...}}
    ]

* ``step``: int >= 0, the optimizer step the record closes (strictly increasing).
* ``loss``: the step's loss as a float, or ``null`` (e.g. a skipped fp16 step).
* ``seconds``: phase name -> wall-clock seconds (float >= 0), the ``Timers.end_step()`` dict. Phases may vary
  between steps; a phase missing from a step counts as 0 there.
* any other key (``lr``, ``tokens``, ``loss_scale``...) is kept in ``extra`` and ignored by the plot.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunRecord:
    """One step of a run log (see the module docstring for the schema); ``seconds`` values are seconds."""

    step: int
    loss: float | None
    seconds: dict[str, float]
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The record as written to the run log."""
        return {"step": self.step, "loss": self.loss, "seconds": dict(self.seconds), **self.extra}


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_record(raw, index: int) -> RunRecord:
    """Validate one raw record (a dict from JSON); ``index`` names it in errors. Raises ``ValueError``."""
    where = f"run log record {index}"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected an object with step, loss, seconds; got {type(raw).__name__}")
    missing = [k for k in ("step", "loss", "seconds") if k not in raw]
    if missing:
        raise ValueError(f"{where}: missing {missing}; a record needs step, loss and seconds")
    step, loss, seconds = raw["step"], raw["loss"], raw["seconds"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: 'step' must be an int >= 0, got {step!r}")
    if loss is not None and not _is_number(loss):
        raise ValueError(f"{where}: 'loss' must be a number or null, got {loss!r}")
    if not isinstance(seconds, Mapping):
        raise ValueError(f"{where}: 'seconds' must map phase -> seconds, got {type(seconds).__name__}")
    for phase, value in seconds.items():
        if not _is_number(value) or value < 0 or not math.isfinite(value):
            raise ValueError(f"{where}: seconds[{phase!r}] must be a finite number >= 0, got {value!r}")
    extra = {k: v for k, v in raw.items() if k not in ("step", "loss", "seconds")}
    return RunRecord(step, None if loss is None else float(loss), {str(k): float(v) for k, v in seconds.items()}, extra)


def load_run_log(source: str | os.PathLike | Iterable[Mapping]) -> list[RunRecord]:
    """Read and validate a run log: a path to a JSON list or JSON Lines file, or the records themselves.

    Raises ``ValueError`` (naming the record and field) for a malformed record, an empty log, or steps that do
    not strictly increase; ``FileNotFoundError`` for a missing file.
    """
    if isinstance(source, (str, os.PathLike)):
        text = pathlib.Path(source).read_text()
        stripped = text.lstrip()
        if stripped.startswith("["):
            raw = json.loads(text)
        else:
            raw = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        raw = list(source)
    records = [parse_record(r, i) for i, r in enumerate(raw)]
    if not records:
        raise ValueError("run log is empty: expected at least one record")
    for i in range(1, len(records)):
        if records[i].step <= records[i - 1].step:
            raise ValueError(
                f"run log record {i}: step {records[i].step} does not follow step {records[i - 1].step}; "
                "steps must strictly increase"
            )
    return records


def write_run_log(records: Iterable[RunRecord | Mapping], path: str | os.PathLike) -> pathlib.Path:
    """Validate ``records`` and write them as one JSON list, atomically (temp file + rename). Returns the path."""
    rows = [r if isinstance(r, RunRecord) else parse_record(r, i) for i, r in enumerate(records)]
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path
