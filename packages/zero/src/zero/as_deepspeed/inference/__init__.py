"""``deepspeed.inference``: ``engine.InferenceEngine`` and ``config.DeepSpeedInferenceConfig`` (zero_inference)."""

from zero.as_deepspeed.inference import config, engine
from zero_inference import DeepSpeedInferenceConfig, InferenceEngine

__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "config", "engine"]
