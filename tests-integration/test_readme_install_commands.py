"""What a new user reads about installing a package agrees with what the package declares.

A user on a fresh clone copies a package README's "Install alone" command: pip finds none of the zero siblings on
PyPI, so the command must name the folder of every sibling the package needs, directly or through another
sibling (``packages/zero/README.md`` left out ``./packages/zero-parallel`` and pip failed with "No matching
distribution found for zero-parallel"). Each README's "Depends on" line gives the sibling ranges its
``pyproject.toml`` declares (they said ``>=0.1.0`` where the pyprojects say ``>=0.2,<0.3``), and the root README's
package table names each package's zero siblings as its pyproject does.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def _siblings(package: str) -> dict[str, SpecifierSet]:
    """The zero siblings ``package`` declares directly, with their version ranges."""
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in meta.get("dependencies", [])]
    return {r.name: r.specifier for r in reqs if r.name in PACKAGES}


def _closure(package: str) -> set[str]:
    todo, seen = [package], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += list(_siblings(name))
    return seen


def _install_section(package: str) -> str:
    text = (ROOT / "packages" / package / "README.md").read_text()
    start = text.index("## Install alone")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize("package", PACKAGES)
def test_install_alone_names_every_sibling_folder_it_needs(package):
    block = _install_section(package).replace("\\\n", " ")
    commands = [line for line in block.splitlines() if "pip install" in line]
    assert commands, f"packages/{package}/README.md: no pip install command under 'Install alone'"
    for command in commands:
        named = set(re.findall(r"\./packages/([a-z-]+)", command))
        missing = _closure(package) - named
        assert not missing, f"packages/{package}/README.md: `{command.strip()}` leaves out {sorted(missing)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_depends_on_gives_the_declared_sibling_ranges(package):
    section = " ".join(_install_section(package).split())
    ranges = re.finditer(r"(zero-[a-z]+)((?:[<>=!~]=?[0-9.]+,?)+)", section)
    said = {m.group(1): SpecifierSet(m.group(2).rstrip(",").rstrip(".")) for m in ranges}
    for sibling, spec in _siblings(package).items():
        assert said.get(sibling) == spec, (
            f"packages/{package}/README.md says {sibling}{said.get(sibling, ' (no range)')}; its pyproject.toml "
            f"declares {sibling}{spec}"
        )


def test_root_table_names_each_packages_siblings():
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| [zero")]
    seen = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        package = re.match(r"\[([a-z-]+)\]", cells[0]).group(1)
        seen.add(package)
        if cells[-1] == "all of the above":
            assert set(_siblings(package)) == set(PACKAGES) - {package}, package
            continue
        named = set(re.findall(r"zero-[a-z]+", cells[-1]))
        assert named == set(_siblings(package)), f"README.md table, {package}: {sorted(named)}"
    assert seen == set(PACKAGES)
