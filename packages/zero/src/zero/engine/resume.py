"""Resume from ``latest`` when asked, and checkpoints every N steps or M minutes (the Engine inherits this).

A run restarted by torchrun's agent (``zero run --max-restarts N``) calls :meth:`ResumeMixin.resume_checkpoint`
with ``mode="auto"`` at start-up: the first launch finds no ``latest`` and starts fresh, a restart continues from
the last checkpoint, so a killed rank costs at most the steps since that checkpoint. Data that depends only on
``global_steps`` (and the rank) is then replayed exactly, so the final parameters equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

RESUME_MODES = ("auto", "never", "must")


@dataclass
class CheckpointInterval:
    """When to save: every ``every_steps`` optimizer steps and/or every ``every_minutes`` minutes of wall clock
    (rank 0's clock, agreed by all ranks through one all-reduce of one int64 per step when minutes are set).

    Raises: ValueError for an interval that is not positive.
    """

    every_steps: int | None = None
    every_minutes: float | None = None
    _last_save: float = field(default=0.0, repr=False)

    def __post_init__(self):
        if self.every_steps is not None and (isinstance(self.every_steps, bool) or self.every_steps < 1):
            raise ValueError(f"checkpoint every_steps must be an int >= 1 or None, got {self.every_steps!r}")
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ValueError(f"checkpoint every_minutes must be > 0 or None, got {self.every_minutes!r}")
        self._last_save = time.monotonic()

    def due(self, global_steps: int, rank: int = 0, group=None) -> bool:
        """Collective when ``every_minutes`` is set (call on every rank after each optimizer step)."""
        by_steps = self.every_steps is not None and global_steps > 0 and global_steps % self.every_steps == 0
        if self.every_minutes is None:
            return by_steps
        late = rank == 0 and time.monotonic() - self._last_save >= 60.0 * self.every_minutes
        flag = torch.tensor([int(late)], dtype=torch.int64)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return by_steps or bool(flag.item())

    def saved(self) -> None:
        """Restart the minutes clock (called after each save)."""
        self._last_save = time.monotonic()


class ResumeMixin:
    """``resume_checkpoint`` and ``save_checkpoint_if_due`` on top of the Engine's save/load_checkpoint."""

    def resume_checkpoint(self, load_dir: str | os.PathLike, mode: str = "auto", **load_kwargs) -> str | None:
        """Load ``load_dir/latest`` as :meth:`load_checkpoint` does, as ``mode`` says; returns the model-states file
        :meth:`load_checkpoint` returns, or None when nothing was loaded.

        Args:
            mode: ``"auto"``: load when ``load_dir/latest`` exists, else start fresh; ``"must"``: load, error when
                missing; ``"never"``: load nothing.
            load_kwargs: passed to :meth:`load_checkpoint` (``load_optimizer_states``...).
        Raises: ValueError for another ``mode``; FileNotFoundError for ``"must"`` without ``latest``.
        """
        if mode not in RESUME_MODES:
            raise ValueError(f"resume mode must be one of {', '.join(RESUME_MODES)}, got {mode!r}")
        latest = os.path.join(os.fspath(load_dir), "latest")
        if mode == "never" or (mode == "auto" and not os.path.isfile(latest)):
            return None
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"resume mode 'must': no checkpoint to resume from ({latest} is missing)")
        path, _ = self.load_checkpoint(load_dir, **load_kwargs)
        return path

    def save_checkpoint_if_due(self, save_dir: str | os.PathLike, interval: CheckpointInterval,
                               client_state: dict | None = None) -> str | None:  # fmt: skip
        """Collective: save (as :meth:`save_checkpoint`) when ``interval`` says so; returns the tag or None."""
        if not interval.due(self.global_steps, self.rank, self.runtime.group):
            return None
        tag = f"global_step{self.global_steps}"
        self.save_checkpoint(save_dir, tag=tag, client_state=client_state)
        interval.saved()
        return tag
