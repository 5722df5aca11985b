"""What only an install from the wheel can show, for one package (run by ``nox -s isolation`` in its venv).

Usage: python tools/isolation_check.py PACKAGE   (e.g. zero-core; from the repository root)

1. The package is imported from the venv's site-packages, not from the source tree.
2. Its files match ``packages/PACKAGE/src/MODULE``: the same relative paths and bytes, so nothing the code reads at
   run time (package data, C++/CUDA sources, the standalone ``zero_to_fp32.py``) was left out of the wheel and no
   stale file was put in.
3. Every module of it imports (``pkgutil.walk_packages``; ``__main__`` modules, which run when imported, aside), so no
   module leans on an undeclared dependency at import time. A module whose import fails only for want of a declared
   *optional* extra (``[project.optional-dependencies]``) is reported and allowed; any other failure is an error.
4. Its console scripts run: each entry point of ``[project.scripts]`` with ``--help`` exits 0.

Exit status 0 on success; otherwise 1 with one line per problem.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as md
import pathlib
import pkgutil
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP_SUFFIXES = (".pyc", ".so", ".o")


def _digests(folder: pathlib.Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder`` but caches and build outputs."""
    out = {}
    for f in folder.rglob("*"):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix not in SKIP_SUFFIXES:
            out[f.relative_to(folder).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _optional_modules(pyproject: dict) -> set[str]:
    """Top-level import names a declared optional extra provides (a distribution's name, normalised)."""
    names = set()
    for reqs in pyproject["project"].get("optional-dependencies", {}).values():
        for r in reqs:
            name = Requirement(r).name.lower().replace("-", "_")
            names.add(name)
            try:
                top = md.distribution(Requirement(r).name).read_text("top_level.txt") or ""
                names |= set(top.split())
            except md.PackageNotFoundError:
                pass
    return names


def compare_files(src: pathlib.Path, installed: pathlib.Path, module: str) -> list[str]:
    """Problems where the installed package's files differ from ``src`` (paths and bytes)."""
    want, got = _digests(src), _digests(installed)
    problems = [f"file missing from the installed package: {module}/{n}" for n in sorted(set(want) - set(got))]
    problems += [f"file in the installed package but not in src/: {module}/{n}" for n in sorted(set(got) - set(want))]
    problems += [f"installed file differs from src/: {module}/{n}" for n in sorted(set(want) & set(got))
                 if want[n] != got[n]]  # fmt: skip
    return problems


def import_all(mod, optional: set[str]) -> tuple[int, list[str], list[str]]:
    """Import every module under package ``mod``: (modules imported, those skipped for an optional extra, problems)."""
    imported, allowed, problems = 0, [], []
    for info in pkgutil.walk_packages(mod.__path__, prefix=f"{mod.__name__}."):
        if info.name.endswith(".__main__"):
            continue  # a script (`python -m ...`): importing it runs it
        try:
            importlib.import_module(info.name)
            imported += 1
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").split(".")[0]
            if missing in optional:
                allowed.append(f"{info.name} (needs the optional {missing})")
            else:
                problems.append(f"import {info.name}: {type(exc).__name__}: {exc}")
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - every failure is reported with its module
            problems.append(f"import {info.name}: {type(exc).__name__}: {exc}")
    return imported, allowed, problems


def check(package: str) -> list[str]:
    """The problems found for ``package`` (empty when it passes)."""
    module = package.replace("-", "_")
    src = ROOT / "packages" / package / "src" / module
    pyproject = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    mod = importlib.import_module(module)
    installed = pathlib.Path(mod.__file__).resolve().parent
    if "site-packages" not in installed.parts:
        return [f"{module} imported from {installed}, not from the venv's site-packages"]
    problems = compare_files(src, installed, module)
    imported, allowed, failed = import_all(mod, _optional_modules(pyproject))
    problems += failed
    print(f"{package}: {len(_digests(src))} files compared with src/; {imported} modules imported"
          + (f"; skipped for optional extras: {', '.join(allowed)}" if allowed else ""))  # fmt: skip
    for script in pyproject["project"].get("scripts", {}):
        run = subprocess.run([str(pathlib.Path(sys.executable).parent / script), "--help"], capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        if run.returncode != 0:
            problems.append(f"console script `{script} --help` exited {run.returncode}: {run.stderr.strip()[-300:]}")
        else:
            print(f"{package}: console script `{script} --help` ran")
    return problems


def main() -> int:
    problems = check(sys.argv[1])
    for p in problems:
        print(f"isolation: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
