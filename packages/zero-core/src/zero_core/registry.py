"""Which live runtime part holds a parameter: the one per-parameter lookup ``GatheredParameters`` and
``register_external_parameter`` need (they get a bare ``Parameter`` from user code).

Keyed weakly by the parameter object (``torch.utils.weak.WeakIdKeyDictionary``: no ``id()`` reuse, no entry
outliving its parameter) and pointing weakly at the owner, so a dropped runtime is freed; ``release`` removes a
closed runtime's entries at once. (FSDP2 reaches its state through the module instead; a bare parameter is what
DeepSpeed's APIs take.)
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""parameter -> (weak reference to its owner, the owner's handle for it, e.g. its stage-3 unit)."""


def claim(owner, entries: list[tuple[torch.Tensor, object]]) -> None:
    """Record ``owner`` (held weakly) as the holder of each ``(param, handle)``."""
    me = weakref.ref(owner)
    for p, handle in entries:
        _OWNERS[p] = (me, handle)


def lookup(p: torch.Tensor):
    """``(owner, handle)`` for a parameter held by a live owner, else None."""
    entry = _OWNERS.get(p)
    if entry is None:
        return None
    owner = entry[0]()
    return None if owner is None else (owner, entry[1])


def release(owner) -> None:
    """Forget every parameter ``owner`` claimed (its runtime was closed)."""
    for p in [p for p, (ref, _) in list(_OWNERS.items()) if ref() is owner or ref() is None]:
        _OWNERS.pop(p, None)


def size() -> int:
    """Number of parameters currently claimed (tests: closing runtimes must not grow it)."""
    return len(_OWNERS)
