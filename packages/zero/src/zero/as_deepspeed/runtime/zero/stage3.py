"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 memory estimator (``zero.estimate``)."""

from zero.estimate import estimate_zero3_model_states_mem_needs_all_live, model_to_params

__all__ = ["estimate_zero3_model_states_mem_needs_all_live", "model_to_params"]
