"""DeepSpeed names zero does not implement: a clear ``NotSupportedError`` instead of an ``AttributeError``."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from zero.config.errors import NotSupportedError


class UnsupportedName(NotSupportedError, AttributeError):
    """A DeepSpeed name zero knows but does not implement. The message names it and what to use instead.

    It is also an ``AttributeError`` so that ``hasattr(deepspeed, name)`` and ``getattr(..., default)`` (how
    libraries probe optional DeepSpeed features) answer "absent" instead of crashing.
    """


def unsupported_getattr(module: str, names: Mapping[str, str]) -> Callable[[str], object]:
    """A module-level ``__getattr__`` (PEP 562) for ``module`` (its DeepSpeed name, e.g. ``"deepspeed.comm"``).

    Args:
        module: the DeepSpeed module path, used in messages.
        names: DeepSpeed name -> what to use instead (one sentence).

    Returns:
        ``__getattr__(name)``: raises :class:`UnsupportedName` for a name in ``names``, ``AttributeError`` for others.
    """

    def __getattr__(name: str):
        if name in names:
            raise UnsupportedName(f"{module}.{name} is not supported by zero: {names[name]}")
        raise AttributeError(f"module {module!r} (served by zero) has no attribute {name!r}")

    return __getattr__
