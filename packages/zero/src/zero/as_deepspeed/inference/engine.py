"""``deepspeed.inference.engine``: the module path of DeepSpeed's ``InferenceEngine`` (zero_inference's)."""

from zero_inference import InferenceEngine

__all__ = ["InferenceEngine"]
