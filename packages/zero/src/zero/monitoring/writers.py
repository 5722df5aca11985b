"""One writer per monitor backend. Each takes DeepSpeed-style events ``(name, value, step)`` (``step`` is the
number of samples trained, as DeepSpeed's engine writes) and is used from rank 0 only."""

from __future__ import annotations

import csv
import os

from zero.config.errors import ConfigError


def _require(module: str, extra: str, what: str):
    """Import ``module`` or raise a ConfigError naming the config key and the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"config key '{what}.enabled' is true but the {module!r} package is not installed; "
                          f"install it with: pip install 'zero[{extra}]'") from None  # fmt: skip


def _log_dir(output_path: str, job_name: str) -> str:
    """``output_path/job_name`` (DeepSpeed's layout; an empty output_path means the working directory)."""
    path = os.path.join(output_path or ".", job_name)
    os.makedirs(path, exist_ok=True)
    return path


class TensorBoardWriter:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` into ``output_path/job_name``."""

    def __init__(self, section):
        _require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = _log_dir(section.output_path, section.job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvWriter:
    """DeepSpeed's csv_monitor layout: ``<log_dir>/<name with '/' and ' ' as '_'>.csv`` holding a header row
    ``step,<last '/'-part of the name>`` then one ``step,value`` row per event."""

    def __init__(self, section):
        self.log_dir = _log_dir(section.output_path, section.job_name)
        self.started: set[str] = set()

    def write_events(self, events) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a", newline="") as f:
                out = csv.writer(f)
                if filename not in self.started:
                    self.started.add(filename)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([step, value])

    def flush(self) -> None:
        """Each write is closed at once: nothing to flush."""

    def close(self) -> None:
        """Nothing held open."""


class WandbWriter:
    """``wandb.init(project, group, entity=team)`` then ``wandb.log({name: value}, step=step)`` per event."""

    def __init__(self, section):
        self.wandb = _require("wandb", "wandb", "wandb")
        # WANDB_DIR read now, not from wandb's process-wide settings cached by an earlier run in this process
        self.run = self.wandb.init(project=section.project, group=section.group, entity=section.team,
                                   dir=os.environ.get("WANDB_DIR"))  # fmt: skip

    def write_events(self, events) -> None:
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def flush(self) -> None:
        """wandb streams on its own."""

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    """``comet_ml.start(...)``; each event name logged at most every ``samples_log_interval`` samples (DeepSpeed's
    EventsLogScheduler)."""

    def __init__(self, section):
        comet_ml = _require("comet_ml", "comet", "comet")
        self.experiment = comet_ml.start(api_key=section.api_key, project=section.project,
                                         workspace=section.workspace, experiment_key=section.experiment_key,
                                         mode=section.mode, online=section.online)  # fmt: skip
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)
        self.interval = section.samples_log_interval
        self.last: dict[str, int] = {}

    def write_events(self, events) -> None:
        for name, value, step in events:
            if name in self.last and step - self.last[name] < self.interval:
                continue
            self.last[name] = step
            self.experiment.log_metric(name, value, step=step)

    def flush(self) -> None:
        """comet_ml streams on its own."""

    def close(self) -> None:
        self.experiment.end()
