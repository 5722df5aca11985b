"""The release API check (tools/api_check.py, run by `nox -s compat`) on zero-comm's real sources: a removed
parameter of an exported function fails the check until a breaking-change fragment names it; a change inside an
internal module is not public API; the multi-rank harness (a declared public module) is."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "packages" / "zero-comm"


def _api_check():
    spec = importlib.util.spec_from_file_location("api_check", ROOT / "tools" / "api_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def trees(tmp_path):
    """(old src, new package folder): two copies of zero-comm's sources, the new one to be edited."""
    old, new = tmp_path / "old" / "src", tmp_path / "new"
    shutil.copytree(PACKAGE / "src" / "zero_comm", old / "zero_comm")
    shutil.copytree(PACKAGE / "src" / "zero_comm", new / "src" / "zero_comm")
    shutil.copy(PACKAGE / "pyproject.toml", new / "pyproject.toml")
    (new / "changes").mkdir()
    return old, new


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} no longer holds {old!r}: update this test"
    path.write_text(text.replace(old, new, 1))


def _run(old: Path, new: Path) -> int:
    return _api_check().main(["zero-comm", str(old), str(new / "src"), str(new / "changes")])


def test_unchanged_sources_pass(trees, capsys):
    assert _run(*trees) == 0
    assert "no unannounced break" in capsys.readouterr().out


def test_a_removed_parameter_fails_until_announced(trees, capsys):
    old, new = trees
    head = "output: torch.Tensor, input: torch.Tensor, group=None, *, async_op: bool = False"
    _edit(new / "src" / "zero_comm" / "collectives.py", head + ', algorithm: str = "auto"\n', head + "\n")
    assert _run(old, new) == 1
    err = capsys.readouterr().err
    assert "UNANNOUNCED" in err and "all_gather_into_tensor" in err and "algorithm" in err
    (new / "changes" / "+gather.feature.md").write_text("`all_gather_into_tensor` lost `algorithm`.\n")
    assert _run(old, new) == 1  # a feature fragment announces nothing
    (new / "changes" / "+gather.breaking.md").write_text("`all_gather_into_tensor` no longer takes `algorithm`.\n")
    assert _run(old, new) == 0
    assert "announced break: zero_comm.collectives.all_gather_into_tensor" in capsys.readouterr().out


def test_internal_modules_are_not_public_but_the_harness_is(trees, capsys):
    old, new = trees
    _edit(new / "src" / "zero_comm" / "rank_order.py", "def reduce_into(", "def reduce_into_renamed(")
    assert _run(old, new) == 0
    _edit(new / "src" / "zero_comm" / "testing" / "harness.py", "def run_ranks(", "def run_ranks_renamed(")
    assert _run(old, new) == 1
    assert "zero_comm.testing" in capsys.readouterr().err
