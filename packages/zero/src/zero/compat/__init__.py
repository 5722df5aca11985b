"""DeepSpeed 0.19.8 compatibility: the names zero cannot honour, and the opt-in ``import deepspeed`` alias.

* :func:`unsupported_getattr` builds a module ``__getattr__`` that raises :class:`UnsupportedName` (a
  ``NotSupportedError``) naming the DeepSpeed name and what to use instead.
* :func:`install_as_deepspeed` serves ``import deepspeed`` from zero, on request only (``zero.alias``).
"""

from zero.compat.unsupported import UnsupportedName, unsupported_getattr

__all__ = ["UnsupportedName", "unsupported_getattr"]
