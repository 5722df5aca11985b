"""``deepspeed.runtime.zero``: the ``deepspeed.zero`` names and the memory estimators' modules."""

from zero.runtime.zero import stage3, stage_1_and_2
from zero.zero import GatheredParameters, Init, register_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "stage3", "stage_1_and_2"]
