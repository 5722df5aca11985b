"""``deepspeed.runtime.zero``: the ``deepspeed.zero`` names and the memory estimators' modules."""

from zero.runtime.zero import partition_parameters, stage3, stage_1_and_2
from zero.zero import GatheredParameters, Init, register_external_parameter

__all__ = [
    "GatheredParameters",
    "Init",
    "partition_parameters",
    "register_external_parameter",
    "stage3",
    "stage_1_and_2",
]
