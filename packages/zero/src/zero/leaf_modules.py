"""Stage-3 leaf modules (served as ``deepspeed.utils.z3_leaf_module``): mark modules as stage-3 leaves (a leaf's
whole subtree of parameters is one unit, gathered when the module is entered, on every rank, and reduced once:
what mixture-of-experts blocks need when ranks route their tokens to different experts). DeepSpeed 0.19.8's
names and signatures over ``zero_core.leaf``; mark before ``initialize()`` (the units are planned there), or name
the modules in the config's ``zero_optimization.leaf_module`` section.
"""

from __future__ import annotations

import torch

from zero_core import leaf as _leaf
from zero_core import stage3

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


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """Whether ``model`` (one module) is marked as a leaf."""
    return _leaf.is_leaf(model)


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    """Whether the parameter belongs to a module marked as a leaf (its own or an ancestor's subtree) of a live
    stage-3 engine's model."""
    entry = stage3.lookup(model)
    if entry is None:
        return False
    return any(any(p is model for p in m.parameters()) for m in _leaf.leaf_modules(entry[0].module))


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` marked as leaves, in ``modules()`` order."""
    return _leaf.leaf_modules(model)


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Mark (True) or unmark (False) one module."""
    _leaf.set_leaf(model, flag)


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    """Mark every module of ``model`` whose class is one of ``leaf_module_classes`` (types, or class names, plain
    or fully qualified). Returns the matched modules.

    Raises:
        TypeError: an entry is neither a type nor a string. ValueError: nothing matched (``raise_if_not_found``).
    """
    return _leaf.mark_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list:
    """Unmark the modules of those classes (see :func:`set_z3_leaf_modules`). Returns the matched modules."""
    return _leaf.mark_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names, flag: bool = True,
                                raise_if_not_found: bool = True):  # fmt: skip
    """Mark the modules named ``module_names`` (``named_modules()`` keys). Returns (matched, missing names).
    Raises ValueError when a name matches nothing and ``raise_if_not_found``."""
    return _leaf.mark_by_name(model, module_names, flag, raise_if_not_found)


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes, flag: bool = True,
                                  raise_if_not_found: bool = True):  # fmt: skip
    """Mark the modules whose names end with one of ``module_name_suffixes``. Returns (matched, missing).
    Raises ValueError when a suffix matches nothing and ``raise_if_not_found``."""
    return _leaf.mark_by_suffix(model, module_name_suffixes, flag, raise_if_not_found)
