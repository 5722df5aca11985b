"""Named wall-clock timers per training step and their breakdown (DeepSpeed's ``wall_clock_breakdown``).

A timer may be started and stopped several times within one step (each collective's wait, each micro-batch's
forward); :meth:`Timers.end_step` closes the step, sums each timer's intervals into that step's seconds and keeps
the per-step history. On a CUDA device the intervals are CUDA events recorded on the current stream and read
only at ``end_step`` (no synchronisation inside the step); on CPU they are ``time.perf_counter`` readings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# DeepSpeed's timer names for the engine's phases, so logs read alike.
FORWARD, BACKWARD, STEP = "forward", "backward", "step"


@dataclass(frozen=True)
class TimerStats:
    """Per-step milliseconds of one timer over the steps in the window: count of steps, mean, median, max, total."""

    name: str
    steps: int
    mean_ms: float
    median_ms: float
    max_ms: float
    total_ms: float


class _Timer:
    def __init__(self, name: str, cuda: bool):
        self.name = name
        self._cuda = cuda
        self._started: float | torch.cuda.Event | None = None
        self._cpu_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.ran = False  # stopped at least once since the last take()

    @property
    def running(self) -> bool:
        return self._started is not None

    def start(self) -> None:
        if self._started is not None:
            raise RuntimeError(f"timer {self.name!r} started twice without stop()")
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._started = event
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self._started is None:
            raise RuntimeError(f"timer {self.name!r} stopped without start()")
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._started, end))
        else:
            self._cpu_s += time.perf_counter() - self._started
        self._started = None
        self.ran = True

    def take(self) -> float:
        """Seconds accumulated since the last take (waits for this timer's CUDA events)."""
        seconds = self._cpu_s
        for start, end in self._events:
            end.synchronize()
            seconds += start.elapsed_time(end) / 1e3
        self._cpu_s, self._events, self.ran = 0.0, [], False
        return seconds


class Timers:
    """Named timers, per-step seconds and a mean/median breakdown.

    ``device``: where the timed work runs; ``"cuda"``/``torch.device("cuda:0")`` uses CUDA events, anything else
    ``time.perf_counter``. Default: CUDA events when ``torch.cuda.is_available()``.

    Usage::

        timers = Timers()
        with timers("forward"):
            loss = model(x)
        timers("allgather_wait").start(); handle.wait(); timers("allgather_wait").stop()
        seconds = timers.end_step()          # {"forward": 0.012, "allgather_wait": 0.003}
        report = timers.maybe_report(step, steps_per_print)   # a string every steps_per_print steps, else None

    Errors: ``RuntimeError`` when a timer is started twice, stopped while not running, or still running at
    ``end_step``; ``ValueError`` for ``steps_per_print < 1``.
    """

    def __init__(self, device: str | torch.device | None = None):
        if device is None:
            self._cuda = torch.cuda.is_available()
        else:
            self._cuda = torch.device(device).type == "cuda"
        self._timers: dict[str, _Timer] = {}
        self._history: dict[str, list[float]] = {}
        self._steps = 0

    @property
    def uses_cuda_events(self) -> bool:
        """True when intervals are measured with CUDA events."""
        return self._cuda

    def __call__(self, name: str) -> _TimerHandle:
        """The timer ``name`` (created on first use): ``.start()``, ``.stop()``, or use it as a context manager."""
        if name not in self._timers:
            self._timers[name] = _Timer(name, self._cuda)
        return _TimerHandle(self._timers[name])

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Context manager timing its body under ``name``."""
        with self(name):
            yield

    def end_step(self) -> dict[str, float]:
        """Close the step: returns ``{name: seconds}`` of every timer that ran in it, and records them.

        A timer that did not run in this step is absent from the result (and from that step's history).
        """
        running = [t.name for t in self._timers.values() if t.running]
        if running:
            raise RuntimeError(f"timers still running at end_step: {running}; stop() them first")
        step: dict[str, float] = {}
        for name, timer in self._timers.items():
            if timer.ran:
                seconds = timer.take()
                step[name] = seconds
                self._history.setdefault(name, []).append(seconds)
        self._steps += 1
        return step

    def breakdown(self, names: list[str] | None = None) -> list[TimerStats]:
        """Statistics of each timer over the steps recorded since the last :meth:`reset` (``names``: a subset)."""
        chosen = names if names is not None else list(self._history)
        stats = []
        for name in chosen:
            values = [s * 1e3 for s in self._history.get(name, [])]
            if values:
                stats.append(
                    TimerStats(
                        name, len(values), statistics.fmean(values), statistics.median(values), max(values), sum(values)
                    )
                )
        return stats

    def report(self, names: list[str] | None = None) -> str:
        """One line per timer: ``name: mean X ms, median Y ms over N steps`` (the breakdown as text)."""
        lines = [f"time per step over the last {self._steps} step(s):"]
        for s in self.breakdown(names):
            lines.append(f"  {s.name}: mean {s.mean_ms:.2f} ms, median {s.median_ms:.2f} ms, max {s.max_ms:.2f} ms")
        return "\n".join(lines)

    def maybe_report(
        self, step: int, steps_per_print: int, printer: Callable[[str], None] | None = print, reset: bool = True
    ) -> str | None:
        """Every ``steps_per_print`` steps (``step % steps_per_print == 0``): the report, printed through ``printer``
        (``None``: not printed) and, with ``reset``, the window restarted. Otherwise ``None``.
        """
        if steps_per_print < 1:
            raise ValueError(f"steps_per_print must be >= 1, got {steps_per_print}")
        if step % steps_per_print != 0:
            return None
        text = f"step {step}: " + self.report()
        if printer is not None:
            printer(text)
        if reset:
            self.reset()
        return text

    def reset(self) -> None:
        """Forget the recorded steps (running timers keep running)."""
        self._history = {}
        self._steps = 0


class _TimerHandle:
    """What ``timers(name)`` returns: start/stop, or ``with timers(name): ...``."""

    def __init__(self, timer: _Timer):
        self._timer = timer

    def start(self) -> None:
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()

    def __enter__(self) -> _TimerHandle:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.stop()
