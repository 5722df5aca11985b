"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle.

Semantics follow DeepSpeed's ``deepspeed/runtime/lr_schedules.py`` (its documented formulas; our own code):
``step()`` advances ``last_batch_iteration`` by one and writes the lr for that index into every param group, so the
first ``step()`` sets the lr of iteration 0. Construction does not touch the lr (except OneCycle, which sets
``cycle_min_lr`` and momentum as DeepSpeed does). The engine calls ``step()`` after every optimizer step that was not
skipped. ``warmup_num_steps`` is raised to at least 2 (DeepSpeed does the same to keep log(warmup) non-zero).
"""

from __future__ import annotations

import abc
import math

import torch


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
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        """The lr per group written by the last ``step()``. Raises RuntimeError before the first step."""
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() called before the first scheduler step()")
        return self._last_lr

    def state_dict(self) -> dict:
        """``{"last_batch_iteration": int}`` (DeepSpeed's format)."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        """Restore the iteration index saved by :meth:`state_dict`."""
        self.last_batch_iteration = state["last_batch_iteration"]


def _warmup_fraction(it: int, warmup: int, kind: str) -> float:
    """Fraction of warmup done at iteration ``it < warmup``: log(it+1)/log(warmup) or it/warmup."""
    return math.log(it + 1) / math.log(warmup) if kind == "log" else it / warmup


class WarmupLR(_Schedule):
    """lr = min + (max - min) * gamma; gamma = warmup fraction (log or linear) during warmup, then 1."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=1000, warmup_type="log",
                 last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        self.min_lrs = self._per_group(warmup_min_lr, "warmup_min_lr")
        self.max_lrs = self._per_group(warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        """lr per group at ``last_batch_iteration``; 0.0 before the first step (as DeepSpeed)."""
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then gamma = max(0, (total - it) / max(1, total - warmup)): linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        self.total_num_steps = total_num_steps

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
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]

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
        cos = (1.0 + math.cos(math.pi * done / span)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos)

    def get_lr(self) -> list[float]:
        """lr per group: original lr x :meth:`get_lr_ratio`."""
        r = self.get_lr_ratio()
        return [lr * r for lr in self.org_lrs]


class OneCycle(_Schedule):
    """1cycle (Smith 2018): lr rises from cycle_min_lr to cycle_max_lr over cycle_first_step_size iterations, falls
    back over cycle_second_step_size, then decays as min_lr / (1 + decay_lr_rate x k / decay_step_size).

    With ``cycle_momentum`` (and an optimizer with ``betas``) beta1 moves inversely between cycle_max_mom and
    cycle_min_mom, then grows by (1 + decay_mom_rate x k / decay_step_size). Stair counts are accepted for config
    compatibility; like DeepSpeed's current code, the cycle is continuous.
    """

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):  # fmt: skip
        super().__init__(optimizer, last_batch_iteration)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.decay_step_size = decay_step_size
        self.min_lrs = self._per_group(cycle_min_lr, "cycle_min_lr")
        self.max_lrs = self._per_group(cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = decay_step_size == 0 or decay_lr_rate == 0
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = decay_step_size == 0 or decay_mom_rate == 0
        self.min_moms = [cycle_min_mom] * len(optimizer.param_groups)
        self.max_moms = [cycle_max_mom] * len(optimizer.param_groups)
        if last_batch_iteration == -1:
            for group, lr, mom in zip(optimizer.param_groups, self.min_lrs, self.min_moms):
                group["lr"] = lr
                if self.cycle_momentum:
                    group["betas"] = (mom, group["betas"][1])

    def _scale(self) -> float:
        x = (self.last_batch_iteration + 1) / self.total_size
        x = x - math.floor(x)  # position inside the current cycle, in [0, 1)
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

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


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
              "OneCycle": OneCycle}  # fmt: skip
