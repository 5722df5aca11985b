"""``deepspeed.profiling.flops_profiler``: ``get_model_profile`` and ``FlopsProfiler`` with DeepSpeed's signatures.

Counting is zero_profiler's (exact counts from the ops that run, a ``TorchDispatchMode``); zero_profiler's richer
``Profile`` (forward/backward/outside totals, per-module tree, JSON) stays available as ``zero_profiler.Profile``.
"""

from zero.profiling.flops_profiler.profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "FlopsProfiler",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
