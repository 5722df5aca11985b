"""Safe encoding of nested Python state (scheduler, loss scaler, RNG, client state) into JSON plus tensors.

Loading never unpickles: containers and scalars become JSON, tensors are pulled out into a flat dict saved with
safetensors and referenced by key. Every other type is encoded explicitly, with its type named in the JSON, so it
comes back as the same type (the values training scripts keep in ``client_state``):

* tuples (named tuples by class), sets, frozensets, int dict keys, non-finite floats, bytes;
* numpy arrays and scalars (dtype kept; ``np.float64`` stays ``np.float64``), so ``numpy.random.get_state()``,
  ``random.getstate()`` and ``torch.get_rng_state()`` round-trip;
* ``torch.dtype``, ``torch.device``, ``torch.Size``;
* ``argparse.Namespace``, ``pathlib`` paths (their class kept), enum members (by class and member name),
  dataclass instances (by class, every field encoded; rebuilt without calling ``__init__``/``__post_init__``).

Classes named in a checkpoint (enums, dataclasses, named tuples) are looked up by ``module.qualname`` with
``importlib`` when loading and must be of the kind the tag says; nothing else is imported or executed. Anything else
(functions, modules, open files, arbitrary objects) is :class:`UnsupportedStateError` naming its path.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import math
import pathlib
import sys
from typing import Any

import torch

_TAG = "__zero__"
_PATHS = {c.__name__: c for c in (pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePath,
                                  pathlib.PurePosixPath, pathlib.PureWindowsPath)}  # fmt: skip
ALLOWED = ("None, bool, int, float, str, bytes, list, tuple (named too), set, dict, torch.Tensor, torch.dtype, "
           "torch.device, torch.Size, numpy arrays and scalars, argparse.Namespace, pathlib paths, enum members, "
           "dataclass instances")  # fmt: skip


class UnsupportedStateError(TypeError):
    """A value in a state dict has a type the checkpoint format does not store; the message names its path."""


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _resolve(name: str, kind: str, check) -> type:
    """The class ``module.qualname`` if it passes ``check``; ValueError naming it otherwise."""
    module, qual = name, ""
    while module:  # the longest importable module prefix (qualnames may be nested: Outer.Inner)
        module, _, last = module.rpartition(".")
        qual = f"{last}.{qual}" if qual else last
        try:
            obj = sys.modules.get(module) or importlib.import_module(module)
        except (ImportError, ValueError):
            continue
        for part in qual.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and check(obj):
            return obj
        break
    raise ValueError(f"checkpoint names {kind} class {name!r}, which cannot be found (import its module first)")


def encode(obj: Any, tensors: dict[str, torch.Tensor] | None, prefix: str) -> Any:
    """Return a JSON-able form of ``obj``; tensors are moved (cloned to CPU, contiguous) into ``tensors``.

    Args:
        obj: nested values of the types listed in this module's docstring.
        tensors: receives ``"<prefix>/<path>" -> tensor`` for every tensor found; None only checks that ``obj``
            can be stored (nothing is copied).
        prefix: a unique prefix for this object's tensor keys (also used in error messages).

    Raises:
        UnsupportedStateError: naming the path of a value of another type (e.g. a function or a module).
    """
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if isinstance(obj, enum.Enum):  # before int/str: IntEnum and StrEnum members are ints and strs
        return {_TAG: "enum", "type": _type_name(type(obj)), "name": obj.name}
    if isinstance(obj, int | str) and not hasattr(obj, "dtype"):
        return int(obj) if isinstance(obj, int) else str(obj)
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):  # before float: np.float64 is a float
        if obj.dtype.kind == "O":
            raise UnsupportedStateError(f"{prefix}: numpy array of Python objects cannot be stored in a checkpoint")
        kind = "ndarray" if getattr(obj, "ndim", 0) or type(obj).__name__ == "ndarray" else "npscalar"
        value = obj.tolist()
        return {_TAG: kind, "dtype": str(obj.dtype), "v": encode(value, tensors, prefix) if kind == "npscalar"
                else _finite_list(value)}  # fmt: skip
    if type(obj) is float:
        return obj if math.isfinite(obj) else {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if tensors is not None:
            tensors[prefix] = obj.detach().to("cpu", copy=True).contiguous()
        return {_TAG: "tensor", "key": prefix}
    if isinstance(obj, torch.dtype):
        return {_TAG: "dtype", "v": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {_TAG: "device", "v": str(obj)}
    if isinstance(obj, torch.Size):
        return {_TAG: "size", "v": list(obj)}
    if isinstance(obj, dict):  # OrderedDict and other subclasses come back as dict (equal to the original)
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: encode(v, tensors, f"{prefix}/{k}") for k, v in obj.items()}
        items = []
        for i, (k, v) in enumerate(obj.items()):
            if type(k) not in (str, int):
                raise UnsupportedStateError(f"{prefix}: dict key {k!r} of type {type(k).__name__} (want str or int)")
            items.append([k, encode(v, tensors, f"{prefix}/{i}")])
        return {_TAG: "dict", "items": items}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return {_TAG: "tuple", "v": [encode(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # a named tuple
        return {_TAG: "namedtuple", "type": _type_name(type(obj)),
                "v": [encode(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]}  # fmt: skip
    if type(obj) in (set, frozenset):
        items = sorted(obj, key=repr)  # a fixed order, so equal sets write equal files
        return {_TAG: type(obj).__name__, "v": [encode(v, tensors, f"{prefix}/{i}") for i, v in enumerate(items)]}
    if type(obj) is bytes:
        return {_TAG: "bytes", "v": obj.hex()}
    if type(obj) is argparse.Namespace:
        return {_TAG: "namespace", "v": encode(dict(vars(obj)), tensors, prefix)}
    if type(obj).__name__ in _PATHS and isinstance(obj, pathlib.PurePath):
        return {_TAG: "path", "type": type(obj).__name__, "v": str(obj)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: encode(getattr(obj, f.name), tensors, f"{prefix}/{f.name}") for f in dataclasses.fields(obj)}
        return {_TAG: "dataclass", "type": _type_name(type(obj)), "v": fields}
    raise UnsupportedStateError(
        f"{prefix}: cannot store a value of type {_type_name(type(obj))} in a checkpoint (allowed: {ALLOWED})"
    )


def _finite_list(value: Any) -> Any:
    """numpy ``tolist()`` output with non-finite floats tagged (JSON has no NaN/inf)."""
    if isinstance(value, list):
        return [_finite_list(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {_TAG: "float", "v": repr(value)}
    return value


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

        arr = np.array(decode(obj["v"], tensors), dtype=obj["dtype"])
        return arr if tag == "ndarray" else arr[()]
    if tag == "device":
        return torch.device(obj["v"])
    if tag == "size":
        return torch.Size(obj["v"])
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(decode(v, tensors) for v in obj["v"])
    if tag == "bytes":
        return bytes.fromhex(obj["v"])
    if tag == "namespace":
        return argparse.Namespace(**decode(obj["v"], tensors))
    if tag == "path":
        if obj["type"] not in _PATHS:
            raise ValueError(f"unknown path class {obj['type']!r} in checkpoint JSON")
        return _PATHS[obj["type"]](obj["v"])
    if tag == "enum":
        return _resolve(obj["type"], "enum", lambda c: issubclass(c, enum.Enum))[obj["name"]]
    if tag == "namedtuple":
        cls = _resolve(obj["type"], "named tuple", lambda c: issubclass(c, tuple) and hasattr(c, "_fields"))
        return cls(*(decode(v, tensors) for v in obj["v"]))
    if tag == "dataclass":
        cls = _resolve(obj["type"], "dataclass", dataclasses.is_dataclass)
        out = cls.__new__(cls)
        for name, value in obj["v"].items():
            object.__setattr__(out, name, decode(value, tensors))  # also for frozen dataclasses
        return out
    raise ValueError(f"unknown tag {tag!r} in checkpoint JSON")
