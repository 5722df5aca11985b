"""``deepspeed.profiling`` for ``import zero as deepspeed``: the FLOPs profiler with DeepSpeed's API."""

from zero.profiling import flops_profiler

__all__ = ["flops_profiler"]
