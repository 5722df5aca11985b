"""Find every tensor in a module's output, whatever its structure (dataclass, named tuple, ...), with torch's pytree.

Stage 3 must hook every output tensor that requires grad so the unit is gathered again before its backward; a
tensor it misses makes backward run on a released (empty) parameter and fail deep inside autograd. Lists, tuples,
dicts, named tuples and registered types (e.g. transformers' ``ModelOutput``) are walked by
``torch.utils._pytree``. Dataclasses are registered with pytree the first time they are met
(``register_dataclass``; one walking their fields otherwise). Any other object that holds tensors in its attributes
is an unknown container: :class:`UnknownOutputError` names the module and the type (DeepSpeed #1960 only warned).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class UnknownOutputError(TypeError):
    """A module returned a container pytree does not know, holding tensors zero cannot see into."""


def _register(cls) -> bool:
    try:
        pytree.register_dataclass(cls)
    except Exception:  # noqa: BLE001 - e.g. fields with init=False: walk the fields by hand instead
        return False
    return True


def output_tensors(obj, module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (a module's output), depth first.

    Raises:
        UnknownOutputError: ``obj`` holds an object of an unknown type whose attributes hold tensors; the message
            names ``module``'s class and the type, and says how to register it.
    """
    out: list[torch.Tensor] = []
    todo = [obj]
    while todo:
        leaves = pytree.tree_leaves(todo.pop())
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                out.append(leaf)
            elif isinstance(leaf, _PLAIN):
                continue
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                if _register(type(leaf)):
                    todo.append(leaf)
                else:
                    todo.extend(getattr(leaf, f.name) for f in dataclasses.fields(leaf))
            elif _holds_tensor(leaf):
                raise UnknownOutputError(
                    f"stage 3: module {type(module).__name__} returned a {type(leaf).__qualname__} holding tensors; "
                    "zero cannot find them to re-gather the module's parameters for backward. Return tensors in "
                    "lists, tuples, dicts, named tuples or dataclasses, or register the type with "
                    "torch.utils._pytree.register_pytree_node."
                )
    return out


def _holds_tensor(obj) -> bool:
    attrs = getattr(obj, "__dict__", None)
    values = list(attrs.values()) if isinstance(attrs, dict) else []
    values += [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(values))
