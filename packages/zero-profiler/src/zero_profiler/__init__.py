"""FLOPs profiler on TorchDispatchMode, wall-clock timers, memory report and NVML stats.

Imports torch only; ``nvidia-ml-py`` (extra ``nvml``) and ``matplotlib`` (extra ``plot``) are imported lazily.
"""

from importlib.metadata import version as _version

from zero_profiler.flop_formulas import Category, OpCount, count_op
from zero_profiler.flops_profiler import FlopsProfiler
from zero_profiler.memory import CATEGORIES, MemoryReport, memory_report, rss_bytes
from zero_profiler.model_profile import get_model_profile
from zero_profiler.nvml import GpuStats, NvmlReport, nvml_stats
from zero_profiler.plot import phase_series, plot_run
from zero_profiler.profile import ModuleProfile, PhaseTotals, Profile
from zero_profiler.run_log import RunRecord, load_run_log, parse_record, write_run_log
from zero_profiler.timers import BACKWARD, FORWARD, STEP, Timers, TimerStats

__version__ = _version("zero-profiler")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "BACKWARD",
    "CATEGORIES",
    "FORWARD",
    "STEP",
    "Category",
    "FlopsProfiler",
    "GpuStats",
    "MemoryReport",
    "ModuleProfile",
    "NvmlReport",
    "OpCount",
    "PhaseTotals",
    "Profile",
    "RunRecord",
    "TimerStats",
    "Timers",
    "count_op",
    "get_model_profile",
    "load_run_log",
    "memory_report",
    "nvml_stats",
    "parse_record",
    "phase_series",
    "plot_run",
    "rss_bytes",
    "write_run_log",
]
