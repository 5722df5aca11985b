"""``deepspeed.runtime.zero.stage3``: the ZeRO-3 memory estimator (``zero.estimate``),
``unwrap_model_for_generation`` (``zero.partitioning.generation``) and ``DeepSpeedZeroOptimizer_Stage3`` (an
``isinstance`` check: ``zero.engine.optimizer_kinds``)."""

from zero.engine.optimizer_kinds import DeepSpeedZeroOptimizer_Stage3
from zero.estimate import estimate_zero3_model_states_mem_needs_all_live, model_to_params
from zero.partitioning.generation import unwrap_model_for_generation

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
    "unwrap_model_for_generation",
]
