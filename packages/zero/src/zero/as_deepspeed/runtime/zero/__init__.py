"""``deepspeed.runtime.zero``: the ``deepspeed.zero`` names and the memory estimators' modules."""

from zero.as_deepspeed.runtime.zero import partition_parameters, stage3, stage_1_and_2
from zero.partitioning.gathered import GatheredParameters, register_external_parameter
from zero.partitioning.init import Init

__all__ = [
    "GatheredParameters",
    "Init",
    "partition_parameters",
    "register_external_parameter",
    "stage3",
    "stage_1_and_2",
]
