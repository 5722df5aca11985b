"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Semantics and defaults follow DeepSpeed 0.19.8's ``deepspeed/runtime/lr_schedules.py`` (its formulas; our own
code). Construction with ``last_batch_iteration=-1`` writes the schedule's starting lr into every param group, so
the first optimizer step already runs at it (DeepSpeed PR #6597): ``warmup_min_lr`` for WarmupLR and
WarmupDecayLR, 0 for WarmupCosineLR, ``cycle_min_lr`` for OneCycle, ``lr_range_test_min_lr`` for LRRangeTest.
``step()`` then advances ``last_batch_iteration`` by one and writes the lr for that index, so optimizer step k
(1-based) runs at the lr of iteration k-2 (the starting lr for k=1). The engine calls ``step()`` after every
optimizer step that was not skipped. ``warmup_num_steps`` must be positive and is raised to at least 2 (as
DeepSpeed, to keep log(warmup) non-zero).

One deliberate difference: DeepSpeed's OneCycle with ``cycle_momentum`` writes ``betas = (momentum, 0.99)``,
replacing the optimizer's beta2 with 0.99; zero keeps the optimizer's beta2 (a silent change of beta2 is a bug).
"""

from __future__ import annotations

import abc
import math

import torch

from zero.log import logger


class _Schedule(abc.ABC):
    """Shared step/state plumbing. Subclasses implement ``get_lr() -> list[float]`` (one per param group)."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None

    def _per_group(self, value: float | list[float], name: str) -> list[float]:
        groups = len(self.optimizer.param_groups)
        if isinstance(value, (list, tuple)):
            if len(value) != groups:
                raise ValueError(f"scheduler param '{name}': {len(value)} values given for {groups} param groups")
            return [float(v) for v in value]
        return [float(value)] * groups

    @abc.abstractmethod
    def get_lr(self) -> list[float]:
        """lr per param group at ``last_batch_iteration``."""

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to ``last_batch_iteration`` (default: the next one) and write its lr into the param groups."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write_lrs(self.get_lr())

    def _start(self) -> None:
        """Write the lr of ``last_batch_iteration`` (the starting lr when -1) into the param groups."""
        self._write_lrs(self.get_lr())

    def _write_lrs(self, lrs: list[float]) -> None:
        """Write one lr per param group. A group whose lr is a tensor (a capturable or compiled optimizer) keeps
        that tensor, filled in place, as DeepSpeed's ``update_lr``."""
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The lr per group written at construction or by the last ``step()``.

        Raises RuntimeError when neither happened (built with ``last_batch_iteration >= 0`` and not stepped)."""
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() called before the first scheduler step()")
        return self._last_lr

    def state_dict(self) -> dict:
        """``{"last_batch_iteration": int}`` (DeepSpeed's format)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration index saved by :meth:`state_dict`."""
        self.last_batch_iteration = state["last_batch_iteration"]


def _positive_steps(value: int, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"scheduler param '{name}': must be a positive integer, got {value!r}")
    return value


def _warmup_kind(kind: str) -> str:
    """``"log"`` or ``"linear"``; any other value falls back to ``"log"`` with a warning, as DeepSpeed."""
    if kind in ("log", "linear"):
        return kind
    logger.warning(f"scheduler warmup_type {kind!r} is unknown (expected 'log' or 'linear'); using 'log'")
    return "log"


def _warmup_fraction(it: int, warmup: int, kind: str) -> float:
    """Fraction of warmup done at iteration ``it < warmup``: log(it+1)/log(warmup) or it/warmup."""
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


class WarmupLR(_Schedule):
    """lr = min + (max - min) * gamma; gamma = warmup fraction (log or linear) during warmup, then 1.

    ``warmup_max_lr=None`` (the default, as DeepSpeed 0.19.8) takes each param group's lr at construction.
    Raises ValueError for a non-positive ``warmup_num_steps`` or a per-group list of the wrong length.
    """

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log",
                 last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, _positive_steps(warmup_num_steps, "warmup_num_steps"))
        self.warmup_type = _warmup_kind(warmup_type)
        if last_batch_iteration == -1:
            self._start()

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """lr per group at ``last_batch_iteration``; ``warmup_min_lr`` before the first step (as DeepSpeed)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then gamma = max(0, (total - it) / max(1, total - warmup)): linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):  # fmt: skip
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """lr = optimizer's lr at construction x ratio.

    Warmup: ratio = warmup_min_ratio + (1 - warmup_min_ratio) x fraction. Then, with s = it - warmup + 1 and
    T = total - warmup: ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) x (1 + cos(pi s / T)) / 2).
    """

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=1e-4,
                 warmup_type="log", last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, _positive_steps(warmup_num_steps, "warmup_num_steps"))
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_kind(warmup_type)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._start()

    def get_lr_ratio(self) -> float:
        """The multiplier of the original lr at ``last_batch_iteration`` (0.0 before the first step)."""
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            frac = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # clamped: past total_num_steps the ratio stays at cos_min_ratio (DeepSpeed 0.19.8) instead of rising again
        cos = (1.0 + math.cos(math.pi * min(1.0, done / span))) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos)

    def get_lr(self) -> list[float]:
        """lr per group: original lr x :meth:`get_lr_ratio`."""
        r = self.get_lr_ratio()
        return [lr * r for lr in self.org_lrs]


class OneCycle(_Schedule):
    """1cycle (Smith 2018): lr rises from cycle_min_lr to cycle_max_lr over cycle_first_step_size iterations, falls
    back over cycle_second_step_size (default: the first), then decays as min_lr / (1 + decay_lr_rate x k /
    decay_step_size).

    With ``cycle_momentum`` (and an optimizer with ``betas``) beta1 moves inversely between cycle_max_mom and
    cycle_min_mom, then grows by (1 + decay_mom_rate x k / decay_step_size); beta2 is kept. A stair count > 0 holds
    lr and momentum flat over ``count`` equal stairs of its half cycle (DeepSpeed 0.19.8); 0 is continuous.
    Raises ValueError for ``cycle_first_step_size <= 0`` or ``cycle_second_step_size < 0``.
    """

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"scheduler param 'cycle_first_step_size': must be positive, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"scheduler param 'cycle_second_step_size': must be >= 0, got {cycle_second_step_size}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)  # fmt: skip
        self.decay_step_size = decay_step_size
        self.min_lrs = self._per_group(cycle_min_lr, "cycle_min_lr")
        self.max_lrs = self._per_group(cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.min_moms = self._per_group(cycle_min_mom, "cycle_min_mom")
        self.max_moms = self._per_group(cycle_max_mom, "cycle_max_mom")
        if last_batch_iteration == -1:
            self._write_lrs(self.min_lrs)
            if self.cycle_momentum:
                for group, mom in zip(optimizer.param_groups, self.min_moms):
                    group["betas"] = (mom, group["betas"][1])

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        x = it / self.total_size
        x = x - math.floor(x)  # position inside the current cycle, in [0, 1)
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.first_stair_count if rising else self.second_stair_count
        if stairs > 0:  # from the integer position, so a stair edge is not lost to float rounding
            pos = it % self.total_size
            if pos <= self.first_step_size:
                level = pos * stairs / self.first_step_size
            else:
                level = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(level) / stairs
        return scale

    def get_lr(self) -> list[float]:
        """lr per group at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        k = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [lo / (1 + self.decay_lr_rate * k) for lo in self.min_lrs]

    def get_mom(self) -> list[float]:
        """beta1 per group at ``last_batch_iteration``."""
        if self.last_batch_iteration < self.total_size:
            s = self._scale()
            return [hi - (hi - lo) * s for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        k = (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size
        return [hi * (1 + self.decay_mom_rate * k) for hi in self.max_moms]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance one iteration; write lr and (if cycling momentum) beta1 into every param group."""
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            for group, mom in zip(self.optimizer.param_groups, self.get_mom()):
                group["betas"] = (mom, group["betas"][1])


class LRRangeTest(_Schedule):
    """LR range test (Smith 2018, section 4.1): lr = min_lr x (1 + step_rate x interval), interval = (it + 1) /
    step_size (``staircase``: its floor). Used to find the largest lr that still trains before choosing a cycle.

    Defaults as DeepSpeed 0.19.8: ``lr_range_test_min_lr=1e-3``, ``step_size=2000``, ``step_rate=1.0``,
    ``staircase=False``. Construction writes ``lr_range_test_min_lr``. Raises ValueError for a non-positive
    ``lr_range_test_step_size`` or a per-group list of the wrong length.
    """

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000, lr_range_test_step_rate=1.0,
                 lr_range_test_staircase=False, last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = _positive_steps(lr_range_test_step_size, "lr_range_test_step_size")
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        if last_batch_iteration == -1:
            self._write_lrs(self.min_lrs)

    def get_lr(self) -> list[float]:
        """lr per group at ``last_batch_iteration``."""
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lo * (1 + self.step_rate * interval) for lo in self.min_lrs]


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
              "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}  # fmt: skip
VALID_LR_SCHEDULES = sorted(SCHEDULERS)
"""Scheduler type names the config's ``scheduler.type`` accepts (``deepspeed.runtime.lr_schedules``'s list; Accelerate
checks a scheduler's class name against it)."""
