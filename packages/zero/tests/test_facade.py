"""``zero.as_deepspeed``: DeepSpeed's import paths as a façade that only re-exports zero's own modules.

* Every module of the façade holds imports, ``__all__``, message strings and the ``__getattr__`` that explains
  unsupported names: no function, class or other code (checked on the syntax tree), and every name it imports from
  zero's own modules is that module's object.
* Every DeepSpeed path that ``zero.compat.names`` lists resolves to one object three ways: ``zero.as_deepspeed.X``,
  ``deepspeed.X`` under ``install_as_deepspeed()``, and attribute access after ``import zero as deepspeed``; its
  functions and classes are defined outside the façade.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import types
from pathlib import Path

import pytest

import zero
import zero.as_deepspeed
from zero.compat import alias
from zero.compat.names import IMPORT_PATHS, SUPPORTED

FACADE = "zero.as_deepspeed"


def _facade_modules() -> list[str]:
    names = [FACADE]
    for info in pkgutil.walk_packages(zero.as_deepspeed.__path__, prefix=FACADE + "."):
        names.append(info.name)
    return sorted(names)


def _source(name: str) -> str:
    return Path(importlib.import_module(name).__file__).read_text()


def _is_str(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _allowed(stmt: ast.stmt) -> bool:
    """Imports, the docstring, ``__all__ = [str, ...]``, ``_MESSAGE = str`` and
    ``__getattr__ = unsupported_getattr(str, {str: str or _MESSAGE}[, live_from=module, live=(str, ...)])``."""
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return True
    if isinstance(stmt, ast.Expr):
        return _is_str(stmt.value)
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    target, value = stmt.targets[0].id, stmt.value
    if target == "__all__":
        return isinstance(value, ast.List) and all(_is_str(e) for e in value.elts)
    if target == "__getattr__":
        return (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "unsupported_getattr"
            and _is_str(value.args[0])
            and isinstance(value.args[1], ast.Dict)
            and all(_is_str(k) for k in value.args[1].keys)
            and all(_is_str(v) or isinstance(v, ast.Name) for v in value.args[1].values)
            and all(
                (k.arg == "live_from" and isinstance(k.value, ast.Name))
                or (k.arg == "live" and isinstance(k.value, ast.Tuple) and all(_is_str(e) for e in k.value.elts))
                for k in value.keywords
            )
        )  # fmt: skip
    return target.startswith("_") and target.isupper() and _is_str(value)


@pytest.mark.parametrize("name", _facade_modules())
def test_facade_module_only_re_exports(name):
    tree = ast.parse(_source(name))
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda)
    ]
    bad = [ast.unparse(s)[:80] for s in tree.body if not _allowed(s)]
    assert not bad, f"{name} holds more than re-exports: {bad}"
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    imported = 0
    for stmt in tree.body:
        if not isinstance(stmt, ast.ImportFrom) or stmt.module == "__future__":
            continue
        source = importlib.import_module(stmt.module)
        for a in stmt.names:
            submodule = sys.modules.get(f"{stmt.module}.{a.name}")
            expected = (
                submodule if stmt.module.startswith(FACADE) and submodule is not None else getattr(source, a.name)
            )
            got = module.__dict__[a.asname or a.name]
            assert got is expected, f"{name}.{a.asname or a.name} is not {stmt.module}.{a.name}"
            imported += 1
    assert imported or name == FACADE, f"{name} re-exports nothing"
    for public in getattr(module, "__all__", []):
        obj = getattr(module, public)
        if isinstance(obj, types.FunctionType | type):
            assert not obj.__module__.startswith(FACADE), f"{name}.{public} is defined in the façade"  # fmt: skip


def _walk(path: str) -> tuple[object, str, list[str]]:
    """The object at dotted ``path`` as ``from A.B import C`` finds it: attributes first, importing a submodule only
    where there is no attribute. Returns it, the deepest module on the way and the attribute names after it."""
    parts = path.split(".")
    obj, module, rest = importlib.import_module(parts[0]), parts[0], []
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[: i + 1]))
        if isinstance(obj, types.ModuleType):
            module, rest = ".".join(parts[: i + 1]), []
        else:
            rest.append(part)
    return obj, module, rest


def _imported(module: str, rest: list[str]):
    """``import module`` (through the import system: the alias's finder), then the attributes ``rest``."""
    obj = importlib.import_module(module)
    for part in rest:
        obj = getattr(obj, part)
    return obj


MIRROR_PATHS = sorted(
    {n for n in SUPPORTED if n.startswith("deepspeed.") and n.count(".") > 1} | {p for p, _ in IMPORT_PATHS}
    | {"deepspeed.checkpointing.checkpoint", "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint"}
)  # fmt: skip


@pytest.fixture
def as_deepspeed():
    alias.install_as_deepspeed()
    yield
    alias.uninstall_as_deepspeed()


def test_every_mirror_path_is_one_object_three_ways(as_deepspeed):
    assert len(MIRROR_PATHS) > 40
    for path in MIRROR_PATHS:
        via_facade, module, rest = _walk(FACADE + path[len("deepspeed") :])
        via_alias = _imported("deepspeed" + module[len(FACADE) :], rest)
        via_attributes = _walk("zero" + path[len("deepspeed") :])[0]  # import zero as deepspeed
        via_zero_path = _imported("zero" + module[len(FACADE) :], rest)  # `from zero.comm import X`, as before
        assert module.startswith(FACADE) and via_facade is via_alias is via_attributes is via_zero_path, path
        if isinstance(via_facade, types.ModuleType):
            assert via_facade.__name__.startswith(FACADE), path
            assert sys.modules["deepspeed" + via_facade.__name__[len(FACADE) :]] is via_facade, path
            assert sys.modules["zero" + via_facade.__name__[len(FACADE) :]] is via_facade, path
        elif isinstance(via_facade, types.FunctionType | type):
            assert not via_facade.__module__.startswith(FACADE), path  # defined in zero's own module
    # the namespaces `import zero as deepspeed` reads are the façade's modules, one object per path
    for ns in ("accelerator", "checkpoint", "checkpointing", "comm", "launcher", "ops", "profiling", "runtime",
               "utils", "zero"):  # fmt: skip
        assert getattr(zero, ns) is sys.modules[f"{FACADE}.{ns}"] is importlib.import_module(f"deepspeed.{ns}"), ns
    assert zero.runtime.zero.partition_parameters.Init is zero.zero.Init
    assert zero.checkpointing.checkpoint is zero.runtime.activation_checkpointing.checkpointing.checkpoint
    importlib.import_module("deepspeed.utils.z3_leaf_module")  # importing the module leaves the attribute alone
    assert isinstance(zero.utils.z3_leaf_module, types.FunctionType)  # the function, as DeepSpeed's attribute
    # a variable zero's module reassigns is read live through the façade (DeepSpeed's groups.mpu)
    mpu, before = object(), zero.parallel_groups.mpu
    zero.parallel_groups.mpu = mpu
    try:
        assert zero.utils.groups.mpu is mpu and importlib.import_module("deepspeed.utils.groups").mpu is mpu
    finally:
        zero.parallel_groups.mpu = before
