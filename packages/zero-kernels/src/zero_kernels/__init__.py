"""C++/CUDA ops for ZeRO training (CPU Adam, fused Adam, blockwise quantize) with pure-torch fallbacks."""

__version__ = "0.1.0"
