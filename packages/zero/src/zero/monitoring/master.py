"""``Monitor``: the enabled writers of one engine, fed from rank 0 after every optimizer step."""

from __future__ import annotations

import atexit

from zero.monitoring.writers import CometWriter, CsvWriter, TensorBoardWriter, WandbWriter

WRITERS = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter, "csv_monitor": CsvWriter, "comet": CometWriter}


class Monitor:
    """Writes DeepSpeed's ``Train/Samples/*`` events to every enabled backend (see :mod:`zero.monitoring`).

    Args:
        sections: ``{"tensorboard": TensorBoardSection, ...}``, the config's monitor sections.
        flush_every: flush the writers every this many optimizer steps (``steps_per_print``; None: only on close).

    Raises:
        ConfigError: an enabled monitor's library is not installed (names the extra to install).
    """

    def __init__(self, sections: dict, flush_every: int | None = None):
        self.writers = {k: WRITERS[k](s) for k, s in sections.items() if s.enabled}
        self.flush_every = flush_every
        self.closed = False
        atexit.register(self.close)  # the last steps reach disk even when the script never calls close()

    @classmethod
    def maybe(cls, cfg, rank: int) -> Monitor | None:
        """A Monitor on rank 0 when any monitor section of ``cfg`` is enabled, else None."""
        sections = {k: getattr(cfg, k) for k in WRITERS}
        if rank != 0 or not any(s.enabled for s in sections.values()):
            return None
        return cls(sections, cfg.steps_per_print)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Write ``(name, value, samples)`` events to every backend."""
        for w in self.writers.values():
            w.write_events(events)

    def after_step(self, step: int, events: list[tuple[str, float, int]]) -> None:
        """Write one optimizer step's events; flush every ``flush_every`` steps."""
        self.write_events(events)
        if self.flush_every and step % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        """Push buffered events to disk (tensorboard) or the service."""
        for w in self.writers.values():
            w.flush()

    def close(self) -> None:
        """Flush and close every writer (finishes the wandb run, ends the comet experiment). Idempotent."""
        if not self.closed:
            self.closed = True
            for w in self.writers.values():
                w.close()
