"""``deepspeed.runtime.lr_schedules``: DeepSpeed's schedulers (``zero.optim.schedulers``)."""

from zero.optim.schedulers import VALID_LR_SCHEDULES, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
