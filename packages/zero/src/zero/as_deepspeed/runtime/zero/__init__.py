"""``deepspeed.runtime.zero``: the ``deepspeed.zero`` names, the memory estimators' modules and ``offload_config``
(the enums of ``engine.offload_states``)."""

from zero.as_deepspeed.runtime.zero import (
    offload_config,
    parameter_offload,
    partition_parameters,
    stage3,
    stage_1_and_2,
    utils,
)
from zero.partitioning.gathered import GatheredParameters, register_external_parameter
from zero.partitioning.generation import unwrap_model_for_generation
from zero.partitioning.init import Init

__all__ = [
    "GatheredParameters",
    "Init",
    "offload_config",
    "parameter_offload",
    "partition_parameters",
    "register_external_parameter",
    "stage3",
    "stage_1_and_2",
    "unwrap_model_for_generation",
    "utils",
]
