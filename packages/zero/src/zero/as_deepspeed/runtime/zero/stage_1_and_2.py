"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 memory estimator (``zero.estimate``)."""

from zero.estimate import estimate_zero2_model_states_mem_needs_all_live, model_to_params

__all__ = ["estimate_zero2_model_states_mem_needs_all_live", "model_to_params"]
