"""``deepspeed.utils.z3_leaf_module``: stage-3 leaf modules (``zero.leaf_modules``)."""

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

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
