"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``Init`` and its helpers
(``zero.partitioning``); TRL imports ``ZeroParamStatus`` from here, transformers ``_orig_torch_arange`` and
``zero_wrapper_for_fp_tensor_constructor``."""

from zero.partitioning.gathered import GatheredParameters, register_external_parameter
from zero.partitioning.init import Init, _orig_torch_arange, zero_wrapper_for_fp_tensor_constructor
from zero_core.partitioned_param import ZeroParamStatus

__all__ = [
    "GatheredParameters",
    "Init",
    "_orig_torch_arange",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
    "ZeroParamStatus",
]
