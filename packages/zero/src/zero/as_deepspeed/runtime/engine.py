"""``deepspeed.runtime.engine``: the module path of DeepSpeed's engine class (TRL and PEFT import it from here)."""

from zero.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
