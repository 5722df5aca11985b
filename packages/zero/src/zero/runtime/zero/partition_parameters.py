"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``Init`` and its helpers.

transformers imports this module to wrap ``zero_wrapper_for_fp_tensor_constructor`` around ``torch.arange``
(``prevent_arange_dtype_change``) so that DeepSpeed's ``Init`` does not cast rotary tables. zero's ``Init`` patches
no tensor constructor (see ``zero_core.zero_init``): the wrapper here returns the constructor unchanged and is never
installed, so that patch has nothing to undo. TRL imports ``ZeroParamStatus`` from here to compare with
``param.ds_status``.
"""

from __future__ import annotations

import torch

from zero.zero import GatheredParameters, Init, ZeroParamStatus, register_external_parameter

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """DeepSpeed wraps floating-point tensor constructors with this; zero does not, so ``fn`` comes back as is."""
    return fn


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
]
