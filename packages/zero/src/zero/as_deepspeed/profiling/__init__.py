"""``deepspeed.profiling``: the FLOPs profiler with DeepSpeed's API."""

from zero.as_deepspeed.profiling import flops_profiler

__all__ = ["flops_profiler"]
