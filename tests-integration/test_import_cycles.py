"""No module of a zero package imports, directly or through others, a module that imports it back: a reader can follow
imports one way, and no import works only because of the order modules happen to load in.

Every ``import`` counts, including those inside functions (a function-level import that dodges a cycle is still one) and
those under ``if TYPE_CHECKING:`` (they never run, but a reader following the types still goes round). A name imported
from a package is traced to the module that defines it (``from zero_core import ShardState`` is an import of
``zero_core.shard_state``), and a package's ``__init__`` importing its own modules is how it re-exports them, not a
cycle.
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Modules:
    """The ``.py`` files under some ``src`` folders, by dotted module name, parsed."""

    def __init__(self, src_dirs: list[pathlib.Path]):
        self.files: dict[str, tuple[pathlib.Path, bool]] = {}
        for src in src_dirs:
            for path in src.rglob("*.py"):
                parts = list(path.relative_to(src).with_suffix("").parts)
                is_package = parts[-1] == "__init__"
                self.files[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
        self.trees = {m: ast.parse(p.read_text()) for m, (p, _) in self.files.items()}
        self.reexports: dict[tuple[str, str], tuple[str, str]] = {}
        for mod, (_, is_package) in self.files.items():
            if is_package:
                for node in self.trees[mod].body:
                    if isinstance(node, ast.ImportFrom):
                        for a in node.names:
                            self.reexports[(mod, a.asname or a.name)] = (self._absolute(mod, node), a.name)

    def _absolute(self, mod: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        base = mod.split(".") if self.files[mod][1] else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _defining(self, target: str, name: str) -> str:
        seen = set()
        while f"{target}.{name}" not in self.files and (target, name) in self.reexports:
            if (target, name) in seen:
                break
            seen.add((target, name))
            target, name = self.reexports[(target, name)]
        return f"{target}.{name}" if f"{target}.{name}" in self.files else target

    def graph(self, type_only: bool = False) -> dict[str, set[str]]:
        """module -> the modules of its own package it imports (``type_only``: those under ``if TYPE_CHECKING:``
        too)."""
        out = {}
        for mod, tree in self.trees.items():
            typing_only = set() if type_only else {
                id(k)
                for n in ast.walk(tree)
                if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                for m in n.body
                for k in ast.walk(m)
            }  # fmt: skip
            deps = set()
            for node in ast.walk(tree):
                if id(node) in typing_only:
                    continue
                if isinstance(node, ast.Import):
                    deps |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    deps |= {self._defining(self._absolute(mod, node), a.name) for a in node.names}
            own = self.files[mod][1]
            out[mod] = {
                d
                for d in deps
                if d in self.files and d != mod and d.split(".")[0] == mod.split(".")[0]
                and not (own and d.startswith(mod + "."))
            }  # fmt: skip
        return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_package_has_an_import_cycle():
    graph = _Modules(sorted((ROOT / "packages").glob("*/src"))).graph(type_only=True)
    assert len(graph) > 100  # every package's modules were read
    found = _cycles(graph)
    assert not found, "import cycles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in found
    )


def test_a_cycle_through_a_function_level_import_a_package_reexport_or_a_type_only_import_is_found(tmp_path):
    pkg = tmp_path / "src" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from demo.store import Store\n")
    (pkg / "store.py").write_text("from demo.reader import read\n\nclass Store:\n    pass\n")
    (pkg / "reader.py").write_text("def read():\n    from demo import Store\n    return Store\n")
    typed = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from demo.store import Store\n"
    (pkg / "typed.py").write_text(typed)  # never runs: an edge only when type-only imports count
    (pkg / "annotated.py").write_text(typed.replace("demo.store import Store", "demo.typed import X"))
    (pkg / "typed.py").write_text(typed + "from demo.annotated import Y\n")
    graph = _Modules([tmp_path / "src"]).graph()
    assert _cycles(graph) == [["demo.reader", "demo.store"]]
    assert graph["demo.typed"] == {"demo.annotated"} and graph["demo.annotated"] == set()
    with_types = _Modules([tmp_path / "src"]).graph(type_only=True)
    assert graph["demo.typed"] | {"demo.store"} == with_types["demo.typed"]
    assert sorted(_cycles(with_types)) == [["demo.annotated", "demo.typed"], ["demo.reader", "demo.store"]]
