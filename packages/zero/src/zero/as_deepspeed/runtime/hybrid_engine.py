"""``deepspeed.runtime.hybrid_engine``: the module path of DeepSpeed's hybrid (train and generate) engine class."""

from zero.engine.hybrid import HybridEngine as DeepSpeedHybridEngine

__all__ = ["DeepSpeedHybridEngine"]
