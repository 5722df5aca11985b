"""CPU and NVMe offload of ZeRO optimizer state and parameters."""

__version__ = "0.1.0"
