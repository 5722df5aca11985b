"""Imports point one way: each package imports only the zero packages its layer allows and its pyproject declares."""

import ast
import pathlib
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {
    "zero_comm": set(),
    "zero_kernels": set(),
    "zero_profiler": set(),
    "zero_core": {"zero_comm"},
    "zero_offload": {"zero_core", "zero_comm", "zero_kernels"},
    "zero_parallel": {"zero_comm", "zero_core"},
    "zero_inference": {"zero_comm", "zero_kernels", "zero_parallel"},
    "zero_compile": {"zero_core", "zero_comm", "zero_offload"},
    "zero": {
        "zero_comm",
        "zero_kernels",
        "zero_profiler",
        "zero_core",
        "zero_parallel",
        "zero_inference",
        "zero_offload",
        "zero_compile",
    },
}


def _imports(package_dir: pathlib.Path) -> set[str]:
    found = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return {n for n in found if n in ALLOWED}


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_imports_follow_the_layers(module):
    src = next((ROOT / "packages").glob(f"*/src/{module}"))
    used = _imports(src) - {module}
    assert used <= ALLOWED[module], f"{module} imports {sorted(used - ALLOWED[module])} against the layering"
    declared = tomllib.loads((src.parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    declared_names = {d.split(">")[0].split("=")[0].strip().replace("-", "_") for d in declared}
    assert used <= declared_names, f"{module} imports {sorted(used - declared_names)} without declaring them"
