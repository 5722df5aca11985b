"""``deepspeed.inference.config``: DeepSpeed's inference config classes (zero_inference's, validated without
pydantic)."""

from zero_inference import DeepSpeedInferenceConfig, DeepSpeedTPConfig

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig"]
