"""``deepspeed.runtime.engine``: the module path of DeepSpeed's engine class (TRL and PEFT import it from here)."""

from zero.engine import Engine

DeepSpeedEngine = Engine
"""DeepSpeed's name for zero's engine class (``isinstance`` checks in TRL, PEFT and Accelerate)."""

__all__ = ["DeepSpeedEngine"]
