"""``deepspeed.utils`` for ``import zero as deepspeed``: full and local views of sharded parameters, gradients and
optimizer state (``safe_get_*`` / ``safe_set_*``), stage-3 leaf modules (``set_z3_leaf_modules`` ...), ``zero_to_fp32``,
``logger``, ``groups`` (the data-parallel world).
"""

from zero.compat import unsupported_getattr
from zero.utils import groups, zero_to_fp32
from zero.utils.logging import log_dist, logger
from zero.utils.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
)
from zero.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "zero_to_fp32",
]

__getattr__ = unsupported_getattr(
    "deepspeed.utils",
    {
        "OnDevice": "not implemented; build the model under zero.zero.Init or on the 'meta' device with torch",
        "safe_update_full_grad_vectorized": "not implemented; call safe_set_full_grad per parameter",
        "RepeatingLoader": "not implemented; iterate the engine's training_dataloader per epoch",
    },
)
