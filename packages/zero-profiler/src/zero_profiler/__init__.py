"""FLOPs profiler on TorchDispatchMode, wall-clock timers, memory report and NVML stats."""

__version__ = "0.1.0"
