"""ZeRO stages 1-3, mixed precision, loss scaling, zero_init and sharded checkpoints."""

__version__ = "0.1.0"
