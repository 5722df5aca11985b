"""FLOPs profiler on TorchDispatchMode, wall-clock timers, memory report and NVML stats."""

from zero_profiler.flop_formulas import Category, OpCount, count_op
from zero_profiler.flops_profiler import FlopsProfiler
from zero_profiler.model_profile import get_model_profile
from zero_profiler.profile import ModuleProfile, PhaseTotals, Profile

__version__ = "0.1.0"

__all__ = [
    "Category",
    "FlopsProfiler",
    "ModuleProfile",
    "OpCount",
    "PhaseTotals",
    "Profile",
    "count_op",
    "get_model_profile",
]
