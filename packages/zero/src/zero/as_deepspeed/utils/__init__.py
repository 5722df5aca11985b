"""``deepspeed.utils``: full and local views of sharded parameters, gradients and optimizer state
(``safe_get_*`` / ``safe_set_*``: ``zero.engine.param_access``), stage-3 leaf modules (``zero.leaf_modules``),
``zero_to_fp32`` (``zero.checkpoint_tools.to_fp32``), ``logger`` (``zero.log``), ``groups``
(``zero.parallel_groups``).

``z3_leaf_module`` is the function, as in DeepSpeed: its module is imported first (under another name), so the
function's binding is the one that stays.
"""

from zero.as_deepspeed.utils import groups, logging, tensor_fragment, zero_to_fp32
from zero.as_deepspeed.utils import z3_leaf_module as _z3_leaf_module_path  # noqa: F401
from zero.compat import unsupported_getattr
from zero.engine.param_access import (
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
from zero.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from zero.log import log_dist, logger

__all__ = [
    "get_z3_leaf_modules",
    "groups",
    "log_dist",
    "logger",
    "logging",
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
    "tensor_fragment",
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
