"""Serving one module under two names: ``<prefix>.X`` as the façade module ``zero.as_deepspeed.X``.

Two prefixes use it: ``deepspeed`` under the opt-in alias (:mod:`zero.compat.alias`), and ``zero`` itself for
DeepSpeed's namespaces (``zero.comm``, ``zero.runtime.zero.partition_parameters``, ``zero.utils.groups``, ...),
the paths zero's own code had before the façade, so ``from zero.comm import get_rank`` keeps working. The module
served is the façade's own object (``sys.modules`` holds it under both names: state is shared); its ``__spec__``
stays the façade's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

FACADE = "zero.as_deepspeed"
"""The package holding DeepSpeed's import paths."""
NAMESPACES = frozenset({"accelerator", "checkpoint", "checkpointing", "comm", "git_version_info", "inference",
                        "launcher", "module_inject", "moe", "ops", "pipe", "profiling", "runtime", "utils",
                        "zero"})  # fmt: skip
"""DeepSpeed's top-level namespaces the façade serves (``zero.<name>`` is the façade's module)."""


class FacadeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A meta-path finder serving ``<prefix>.X.Y`` as ``zero.as_deepspeed.X.Y`` (only for ``X`` in
    ``namespaces``, every ``X`` when None); names the façade lacks are left to the other finders."""

    def __init__(self, prefix: str, namespaces: frozenset[str] | None = None):
        self.prefix = prefix
        self.namespaces = namespaces

    def target(self, fullname: str) -> str | None:
        """The façade module serving ``fullname``, or None when this finder does not serve it."""
        head, _, rest = fullname.partition(".")
        if head != self.prefix or not rest:
            return None
        if self.namespaces is not None and rest.partition(".")[0] not in self.namespaces:
            return None
        return f"{FACADE}.{rest}"

    def install(self) -> None:
        """Put this finder first on ``sys.meta_path`` (before PathFinder, which would load a second copy of a
        façade submodule through its parent's ``__path__``) unless one for the same prefix is there, and register
        the façade modules already imported (:meth:`register_imported`)."""
        if not any(isinstance(f, FacadeFinder) and f.prefix == self.prefix for f in sys.meta_path):
            sys.meta_path.insert(0, self)
        self.register_imported()

    def register_imported(self) -> None:
        """Put each façade module already imported in ``sys.modules`` under this prefix too: importing it later
        then leaves its parent's attributes alone (``deepspeed.utils.z3_leaf_module`` stays the function, as in
        DeepSpeed, though a module of that name exists)."""
        for name, module in list(sys.modules.items()):
            if name.startswith(FACADE + "."):
                served = f"{self.prefix}{name[len(FACADE) :]}"
                if self.target(served) is not None:
                    sys.modules.setdefault(served, module)

    def find_spec(self, fullname, path, target=None):
        target_name = self.target(fullname)
        if target_name is None:
            return None
        try:
            if importlib.util.find_spec(target_name) is None:
                return None
        except ModuleNotFoundError:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=f"{self.prefix} -> {target_name}",
                                              is_package=True)  # fmt: skip
        spec.loader_state = target_name
        return spec

    def create_module(self, spec):
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = (spec.loader_state, module.__spec__)
        return module

    def exec_module(self, module):
        spec = module.__spec__
        if isinstance(spec.loader_state, tuple):
            module.__spec__ = spec.loader_state[1]  # the import system overwrote the façade module's spec: restore it
