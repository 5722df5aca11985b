"""Public-API check of one package against its last release (run by ``nox -s compat``; needs griffe).

    python tools/api_check.py PACKAGE OLD_SRC NEW_SRC CHANGES_DIR

``OLD_SRC`` is the package's ``src`` folder at the release's commit, ``NEW_SRC`` the one in this tree. The public API
(docs/releasing.md) is every name in the top-level module's ``__all__`` and everything reachable from it (a class's
public methods, a function's parameters, an exported submodule's public members), plus the modules a package lists
under ``[tool.zero-release] public-modules`` in its pyproject.toml. griffe's ``find_breaking_changes`` compares the
two sources statically (nothing is imported); each breakage inside the public API fails the check unless a
``*.breaking.md`` fragment in ``CHANGES_DIR`` names the exported name in backticks (`` `name` ``) or by its dotted
path. Exit status 0: no unannounced break; 1: the unannounced breaks are listed; 2: bad arguments.
"""

from __future__ import annotations

import pathlib
import sys
import tomllib

import griffe


def public_prefixes(old: griffe.Module, extra_modules: list[str]) -> dict[str, str]:
    """Dotted path -> the public name it belongs to: each exported name's own path and its alias target's path."""
    prefixes: dict[str, str] = {}
    for name in sorted(old.exports or ()):
        member = old.get_member(name) if name in old.all_members else None
        if member is None:
            continue
        prefixes[f"{old.path}.{name}"] = name
        if member.is_alias:
            try:
                prefixes[member.final_target.path] = name
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                pass  # a re-export of a third-party name: only its own path counts
    for module in extra_modules:
        prefixes[module] = module
    return prefixes


def _owner(path: str, prefixes: dict[str, str]) -> str | None:
    for prefix, name in prefixes.items():
        if path == prefix or path.startswith(prefix + "."):
            return name
    return None


def announced(changes: pathlib.Path) -> str:
    """The text of every breaking-change fragment waiting in ``changes``."""
    if not changes.is_dir():
        return ""
    return "\n".join(f.read_text() for f in sorted(changes.glob("*.breaking.md")))


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    package, old_src, new_src, changes = argv[0], *map(pathlib.Path, argv[1:])
    module = package.replace("-", "_")
    pyproject = tomllib.loads((new_src.parent / "pyproject.toml").read_text())
    extra = pyproject.get("tool", {}).get("zero-release", {}).get("public-modules", [])
    old = griffe.load(module, search_paths=[str(old_src)], resolve_aliases=True, resolve_external=False)
    new = griffe.load(module, search_paths=[str(new_src)], resolve_aliases=True, resolve_external=False)
    prefixes = public_prefixes(old, extra)
    notes = announced(changes)
    breaks, allowed = [], []
    for breakage in griffe.find_breaking_changes(old, new):
        name = _owner(breakage.obj.path, prefixes)
        if name is None:
            continue  # an internal module's change: not public API
        line = f"{breakage.obj.path}: {breakage.kind.value} (was {breakage.old_value}, now {breakage.new_value})"
        ok = f"`{name}`" in notes or f"{module}.{name}" in notes
        (allowed if ok else breaks).append(line)
    for line in allowed:
        print(f"{package}: announced break: {line}")
    for line in breaks:
        print(f"{package}: UNANNOUNCED break of the public API: {line}", file=sys.stderr)
    if breaks:
        print(
            f"{package}: {len(breaks)} unannounced break(s) against the last release. Restore the name or signature, "
            f"or announce it: a fragment packages/{package}/changes/<slug>.breaking.md naming it in backticks (the "
            "next release then bumps the breaking digit: docs/releasing.md).",
            file=sys.stderr,
        )
        return 1
    names = len(set(prefixes.values()))
    print(f"{package}: public API ({names} public names) has no unannounced break against the last release")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
