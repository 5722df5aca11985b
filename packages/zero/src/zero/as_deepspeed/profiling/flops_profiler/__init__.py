"""``deepspeed.profiling.flops_profiler``: ``get_model_profile`` and ``FlopsProfiler`` (``zero.flops_profiler``)."""

from zero.as_deepspeed.profiling.flops_profiler import profiler
from zero.flops_profiler import (
    FlopsProfiler,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    "duration_to_string",
    "flops_to_string",
    "FlopsProfiler",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
    "profiler",
]
