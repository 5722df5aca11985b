"""DeepSpeed names zero does not implement: a clear ``NotSupportedError`` instead of an ``AttributeError``, on
attribute access and on ``from deepspeed.X import Y`` / ``import deepspeed.X.Y`` alike."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Mapping

from zero.config.errors import NotSupportedError


class UnsupportedName(NotSupportedError, AttributeError):
    """A DeepSpeed name zero knows but does not implement. The message names it and what to use instead.

    It is also an ``AttributeError`` so that ``hasattr(deepspeed, name)`` and ``getattr(..., default)`` (how
    libraries probe optional DeepSpeed features) answer "absent" instead of crashing.
    """


_REGISTRY: dict[str, Mapping[str, str]] = {}
"""DeepSpeed module path (``"deepspeed.utils"``) -> {unsupported name: what to use instead}."""


def _message(module: str, name: str) -> str:
    return f"{module}.{name} is not supported by zero: {_REGISTRY[module][name]}"


def unsupported_getattr(
    module: str, names: Mapping[str, str], live_from: types.ModuleType | None = None, live: tuple[str, ...] = ()
) -> Callable[[str], object]:
    """A module-level ``__getattr__`` (PEP 562) for ``module`` (its DeepSpeed name, e.g. ``"deepspeed.comm"``).

    The names are also registered with the import hook (:class:`_UnsupportedFinder`), so that ``from module import
    name`` and ``import module.name`` raise the same :class:`UnsupportedName`: Python turns an ``AttributeError``
    met by ``from ... import`` into a bare ``ImportError``, but lets an error raised while importing the
    submodule ``module.name`` through (this works for packages, which all of zero's DeepSpeed namespaces are).

    Args:
        module: the DeepSpeed module path, used in messages.
        names: DeepSpeed name -> what to use instead (one sentence).
        live_from, live: module-level variables that zero's module ``live_from`` reassigns (``groups.mpu``): each
            name in ``live`` is read from it at every access, so a façade module that re-exports it never holds
            a stale value.

    Returns:
        ``__getattr__(name)``: the current ``live_from.<name>`` for a name in ``live``; raises
        :class:`UnsupportedName` for a name in ``names``, ``AttributeError`` for others.
    """
    _REGISTRY[module] = names
    _install_finder()

    def __getattr__(name: str):
        if name in live:
            return getattr(live_from, name)
        if name in names:
            raise UnsupportedName(_message(module, name))
        raise AttributeError(f"module {module!r} (served by zero) has no attribute {name!r}")

    return __getattr__


def register_unsupported(module: str, names: Mapping[str, str]) -> None:
    """Register ``names`` of ``module`` with the import hook only (a module with its own ``__getattr__``)."""
    _REGISTRY[module] = names
    _install_finder()


def unsupported_message(fullname: str) -> str | None:
    """The :class:`UnsupportedName` message for a module path (``deepspeed.ops.lion``, or the façade's
    ``zero.as_deepspeed.ops.lion``; ``zero.lion`` for a top-level name) naming a registered unsupported name, else
    None."""
    for prefix in ("zero.as_deepspeed", "zero"):
        if fullname == prefix or fullname.startswith(prefix + "."):
            fullname = "deepspeed" + fullname[len(prefix) :]
            break
    if "." not in fullname:
        return None
    parent, name = fullname.rsplit(".", 1)
    if name in _REGISTRY.get(parent, {}):
        return _message(parent, name)
    return None


_SERVING_DEEPSPEED = [False]
"""Whether ``deepspeed.*`` is zero's (the opt-in alias is active); else a real DeepSpeed's paths are its own."""


def answer_deepspeed_paths(on: bool) -> None:
    """Called by ``zero.compat.alias`` as it installs (True) or removes (False) the ``deepspeed`` alias: only then
    does the finder answer for ``deepspeed.X.Y``. A plain ``import zero`` must leave a real DeepSpeed's imports to it
    (its ``__init__`` imports ``deepspeed.ops.adagrad``, a name zero lacks)."""
    _SERVING_DEEPSPEED[0] = on


class _UnsupportedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``zero.X.Y`` (and, while the alias serves ``deepspeed``, ``deepspeed.X.Y``) when ``Y`` is a registered
    unsupported name of ``X``; loading it raises :class:`UnsupportedName` (so a ``find_spec`` probe is answered, and
    the import itself explains)."""

    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("deepspeed.") and not _SERVING_DEEPSPEED[0]:
            return None
        if unsupported_message(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin="zero: not supported")

    def create_module(self, spec):
        raise UnsupportedName(unsupported_message(spec.name))

    def exec_module(self, module):  # never reached: create_module raises
        raise UnsupportedName(unsupported_message(module.__name__))


def _install_finder() -> None:
    if not any(isinstance(f, _UnsupportedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _UnsupportedFinder())
