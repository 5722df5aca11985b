"""``deepspeed.runtime.zero.stage_1_and_2``: the ZeRO-2 memory estimator (``zero.estimate``) and
``DeepSpeedZeroOptimizer`` (an ``isinstance`` check: ``zero.engine.optimizer_kinds``)."""

from zero.engine.optimizer_kinds import DeepSpeedZeroOptimizer
from zero.estimate import estimate_zero2_model_states_mem_needs_all_live, model_to_params

__all__ = ["DeepSpeedZeroOptimizer", "estimate_zero2_model_states_mem_needs_all_live", "model_to_params"]
