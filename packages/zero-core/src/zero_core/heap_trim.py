"""Freed host memory that glibc keeps, given back while a CPU training process runs.

A training step on the CPU allocates and frees the same activation, gradient and unit-buffer sizes every step. With
the mmap threshold where training wants it (``zero_core.materialize.HostThresholds.for_training``: freed blocks are
reused from the heap, not mapped afresh) glibc keeps the freed pages resident, and as the heap fragments each step
places some blocks on pages no earlier step touched: the process's resident memory creeps up step after step (the
main job: about 3 MiB a step at first, slowing over hundreds of steps) while what is live stays the same (no Python
object, tensor or cache grows: ``tests-integration/test_host_memory_per_step.py``). :class:`FreedHeapTrim` bounds
it: after each optimizer step it reads the resident size (``/proc/self/statm``, no system call beyond the read) and,
once that exceeds the level it settled at after warm-up by more than ``slack``, gives the freed pages back
(glibc's ``malloc_trim(0)``), which costs the next step the page faults of re-touching them; when the step after a
trim is still above the bound, what a step uses grew (an evaluation, a resize) and that becomes the new level.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from zero_core.materialize import return_freed_host_memory


def resident_bytes() -> int:
    """This process's resident set size now, in bytes (``/proc/self/statm``); 0 where ``/proc`` is absent."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class FreedHeapTrim:
    """Keeps a CPU training process's resident memory within ``slack`` of its level after warm-up (see the module
    docstring). One per stage-3 store training on the CPU; :meth:`after_step` after every optimizer step.

    Args:
        warmup_steps: optimizer steps before the level is read (the first steps allocate the optimizer state and
            settle the allocator).
        slack: the fraction above the level that resident memory may reach before freed pages are given back.
        rss: reads the resident size in bytes (0: unknown, nothing is done).
        trim: gives freed heap pages back to the OS; returns whether it could.

    Attributes:
        steps: optimizer steps seen.
        level: the resident bytes the bound is relative to (None until warm-up ends).
        trims: times freed pages were given back.
        trimmed_last: the last step gave them back (a step right after a trim that is still above the bound moves
            the level there instead of trimming again: never a trim at every step).
    """

    def __init__(self, *, warmup_steps: int = 10, slack: float = 0.05, rss: Callable[[], int] = resident_bytes,
                 trim: Callable[[], bool] = return_freed_host_memory):  # fmt: skip
        if warmup_steps < 1 or slack <= 0:
            raise ValueError(f"FreedHeapTrim: warmup_steps must be >= 1 and slack > 0, got {warmup_steps}, {slack}")
        self.warmup_steps, self.slack = warmup_steps, slack
        self._rss, self._trim = rss, trim
        self.steps = 0
        self.level: int | None = None
        self.trims = 0
        self.trimmed_last = False

    def after_step(self) -> bool:
        """An optimizer step ended: give freed pages back when resident memory passed the bound. Returns whether
        it did."""
        self.steps += 1
        if self.steps < self.warmup_steps:
            return False
        now = self._rss()
        if now <= 0:
            return False
        if self.level is None:
            self.level = now
            return False
        bound = self.level * (1 + self.slack)
        if now <= bound:
            self.trimmed_last = False
            return False
        if self.trimmed_last:  # a step after a trim is still above the bound: what a step uses grew
            self.level, self.trimmed_last = now, False
            return False
        if not self._trim():
            return False
        self.trims += 1
        self.trimmed_last = True
        return True
