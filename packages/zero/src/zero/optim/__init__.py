"""Optimizers and learning-rate schedules built from a DeepSpeed-style config."""

from zero.optim.optimizers import build_optimizer
from zero.optim.schedulers import SCHEDULERS, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def build_scheduler(section, optimizer):
    """The schedule named by the config's `scheduler` section, over ``optimizer`` (see zero.optim.schedulers)."""
    params = section.typed_params()
    return SCHEDULERS[section.type](optimizer, **params.model_dump())


__all__ = [
    "LRRangeTest", "OneCycle", "SCHEDULERS", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_optimizer",
    "build_scheduler",
]  # fmt: skip
