"""The core's shape in numbers: reaches into a shared runtime, attributes born outside ``__init__``, import circles.

Static (reads the source, runs nothing), over zero-core, zero-offload and zero-compile (the packages whose stores
plug into ``ZeroRuntime``):

- *runtime reaches*: attribute reads through a name or attribute called ``rt`` / ``runtime`` (``rt.flat_groups``,
  ``self.rt.config``, ``self._rt.group``): a store that holds the whole runtime instead of the few things it uses.
  Not counted: ``zero_core/runtime.py`` (the runtime itself) and ``zero_core/checkpoint/`` (save and load take a
  ``Checkpointable``, a protocol, under the name ``runtime``; ``checkpoint/zero_runtime.py`` is the runtime's own
  view of itself through it).
- *late attributes*: ``self.X = ...`` in a method other than ``__init__`` where ``X`` is declared neither in
  ``__init__``, nor in the class body, nor by a base class of the same file.
- *import circles*: strongly connected groups of modules of one package, counting every import, those under
  ``if TYPE_CHECKING:`` included (``tests-integration/test_import_cycles.py`` leaves those out).

Usage: python tools/house_metrics.py [--list]   (--list names every finding)
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ["zero-core", "zero-offload", "zero-compile"]
RUNTIME_NAMES = {"rt", "_rt", "runtime", "_runtime"}


def _sources(packages: list[str]) -> list[pathlib.Path]:
    return sorted(f for p in packages for f in (ROOT / "packages" / p / "src").rglob("*.py"))


def runtime_reaches(path: pathlib.Path) -> list[str]:
    """``rt.x`` / ``self.rt.x`` reads in ``path``, as 'file:line rt.x'."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name in RUNTIME_NAMES:
            out.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return out


def _self_targets(fn: ast.AST) -> set[str]:
    names = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)):
            targets = [n.target]
        else:
            continue
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    names.add(e.attr)
    return names


def late_attributes(path: pathlib.Path) -> list[str]:
    """Attributes a method other than ``__init__`` creates, as 'file:line Class.attr (in method)'."""
    tree = ast.parse(path.read_text())
    classes = {c.name: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}
    declared: dict[str, set[str]] = {}

    def declared_in(cls: ast.ClassDef) -> set[str]:
        if cls.name in declared:
            return declared[cls.name]
        names: set[str] = set()
        declared[cls.name] = names
        for n in cls.body:
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
            elif isinstance(n, ast.Assign):
                names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
            elif isinstance(n, ast.FunctionDef) and n.name == "__init__":
                names |= _self_targets(n)
            elif isinstance(n, ast.FunctionDef) and any(ast.unparse(d) == "property" for d in n.decorator_list):
                names.add(n.name)
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                names |= declared_in(classes[base.id])
        return names

    out = []
    for cls in classes.values():
        known = declared_in(cls)
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name != "__init__":
                for attr in sorted(_self_targets(fn) - known):
                    out.append(f"{path.relative_to(ROOT)}:{fn.lineno} {cls.name}.{attr} (in {fn.name})")
    return out


def import_circles() -> list[list[str]]:
    """Import circles of every package, type-only imports included."""
    spec = importlib.util.spec_from_file_location("_cycles", ROOT / "tests-integration" / "test_import_cycles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    graph = mod._Modules(sorted((ROOT / "packages").glob("*/src"))).graph(type_only=True)
    return mod._cycles(graph)


def main() -> None:
    listing = "--list" in sys.argv
    skip = ("packages/zero-core/src/zero_core/runtime.py", "packages/zero-core/src/zero_core/checkpoint/")
    files = [f for f in _sources(PACKAGES) if not f.relative_to(ROOT).as_posix().startswith(skip)]
    reaches = [r for f in files for r in runtime_reaches(f)]
    late = [a for f in _sources(PACKAGES) for a in late_attributes(f)]
    circles = import_circles()
    print(f"runtime reaches: {len(reaches)} in {len({r.split(':')[0] for r in reaches})} files")
    if listing:
        print("\n".join(f"  {r}" for r in reaches))
    print(f"late attributes: {len(late)}")
    if listing:
        print("\n".join(f"  {a}" for a in late))
    print(f"import circles (type-only imports counted): {len(circles)}")
    for c in circles:
        print("  " + " <-> ".join(c))


if __name__ == "__main__":
    main()
