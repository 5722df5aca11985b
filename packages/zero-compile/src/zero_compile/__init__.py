"""torch.compile passes for ZeRO-3 (gather/release, prefetch) in the style of DeepCompile."""

__version__ = "0.1.0"
