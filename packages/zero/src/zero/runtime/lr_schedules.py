"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers (zero's implementations in ``zero.optim``)."""

from zero.optim.schedulers import SCHEDULERS, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

VALID_LR_SCHEDULES = sorted(SCHEDULERS)
"""Scheduler type names the config's ``scheduler.type`` accepts (Accelerate checks a scheduler's class name here)."""

__all__ = ["VALID_LR_SCHEDULES", "LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
