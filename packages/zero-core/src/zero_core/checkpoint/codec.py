"""Safe encoding of nested Python state (scheduler, loss scaler, RNG, client state) into JSON plus tensors.

Loading never unpickles: containers and scalars become JSON, tensors are pulled out into a flat dict saved with
safetensors and referenced by key. Tuples, int dict keys, numpy arrays, ``torch.dtype`` and non-finite floats are
tagged so that they come back as the same types.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_TAG = "__zero__"


class UnsupportedStateError(TypeError):
    """A value in a state dict has a type the checkpoint format does not store; the message names its path."""


def encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """Return a JSON-able form of ``obj``; tensors are moved (cloned to CPU, contiguous) into ``tensors``.

    Args:
        obj: nested dicts/lists/tuples of None, bool, int, float, str, torch.Tensor, torch.dtype, numpy arrays.
        tensors: receives ``"<prefix>/<path>" -> tensor`` for every tensor found.
        prefix: a unique prefix for this object's tensor keys (also used in error messages).

    Raises:
        UnsupportedStateError: naming the path of a value of another type (e.g. a function or a module).
    """
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}"
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {_TAG: "tensor", "key": key}
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "v": str(obj).removeprefix("torch.")}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: encode(v, tensors, f"{prefix}/{k}") for k, v in obj.items()}
        items = []
        for i, (k, v) in enumerate(obj.items()):
            if not isinstance(k, str | int):
                raise UnsupportedStateError(f"{prefix}: dict key {k!r} of type {type(k).__name__} (want str or int)")
            items.append([k, encode(v, tensors, f"{prefix}/{i}")])
        return {_TAG: "dict", "items": items}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [encode(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]}
    if type(obj).__module__ == "numpy":
        if hasattr(obj, "tolist") and hasattr(obj, "dtype"):
            kind = "ndarray" if getattr(obj, "ndim", 0) else "npscalar"
            return {_TAG: kind, "dtype": str(obj.dtype), "v": obj.tolist()}
    raise UnsupportedStateError(
        f"{prefix}: cannot store a value of type {type(obj).__module__}.{type(obj).__qualname__} in a checkpoint "
        "(allowed: None, bool, int, float, str, list, tuple, dict, torch.Tensor, torch.dtype, numpy arrays)"
    )


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`; ``tensors`` must hold every referenced key.

    Raises:
        KeyError: a referenced tensor is missing (names the key).
    """
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: decode(v, tensors) for k, v in obj.items()}
    if tag == "tensor":
        if obj["key"] not in tensors:
            raise KeyError(f"checkpoint references tensor {obj['key']!r}, which is not in its tensor file")
        return tensors[obj["key"]]
    if tag == "float":
        return float(obj["v"])
    if tag == "dtype":
        return getattr(torch, obj["v"])
    if tag == "dict":
        return {k: decode(v, tensors) for k, v in obj["items"]}
    if tag == "tuple":
        return tuple(decode(v, tensors) for v in obj["v"])
    if tag in ("ndarray", "npscalar"):
        import numpy as np

        arr = np.array(obj["v"], dtype=obj["dtype"])
        return arr if tag == "ndarray" else arr[()]
    raise ValueError(f"unknown tag {tag!r} in checkpoint JSON")
