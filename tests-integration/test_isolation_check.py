"""tools/isolation_check.py (run by `nox -s isolation` in each package's venv) finds what a wheel install breaks: a
file left out of the wheel, a stray one, one that differs from src/; a module that imports an undeclared dependency
(one needing a declared optional extra is allowed), and it never runs a package's `__main__` while importing."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("isolation_check", ROOT / "tools" / "isolation_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_files_left_out_added_or_changed_are_named(tmp_path):
    src = ROOT / "packages" / "zero-comm" / "src" / "zero_comm"
    installed = tmp_path / "zero_comm"
    shutil.copytree(src, installed, ignore=shutil.ignore_patterns("__pycache__"))
    tool = _tool()
    assert tool.compare_files(src, installed, "zero_comm") == []
    (installed / "window.py").unlink()
    (installed / "stray.py").write_text("x = 1\n")
    (installed / "logger.py").write_text((src / "logger.py").read_text() + "\n# edited\n")
    (installed / "__pycache__").mkdir()
    (installed / "__pycache__" / "logger.cpython-311.pyc").write_bytes(b"cache")  # caches are not files of the wheel
    assert tool.compare_files(src, installed, "zero_comm") == [
        "file missing from the installed package: zero_comm/window.py",
        "file in the installed package but not in src/: zero_comm/stray.py",
        "installed file differs from src/: zero_comm/logger.py",
    ]


def test_every_module_imported_undeclared_imports_named_optional_ones_allowed(tmp_path, monkeypatch):
    pkg = tmp_path / "demo_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "plain.py").write_text("import json\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "extra.py").write_text("import demo_optional_dep\n")
    (pkg / "undeclared.py").write_text("import demo_undeclared_dep\n")
    (pkg / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    (pkg / "__main__.py").write_text("import sys\nsys.exit(3)\n")  # running it would end the check early
    monkeypatch.syspath_prepend(str(tmp_path))
    import demo_pkg

    try:
        imported, allowed, problems = _tool().import_all(demo_pkg, {"demo_optional_dep"})
    finally:
        for name in [n for n in sys.modules if n == "demo_pkg" or n.startswith("demo_pkg.")]:
            del sys.modules[name]
    assert imported == 2  # plain, sub (the package itself is imported by the caller)
    assert allowed == ["demo_pkg.sub.extra (needs the optional demo_optional_dep)"]
    assert problems == [
        "import demo_pkg.broken: RuntimeError: boom at import",
        "import demo_pkg.undeclared: ModuleNotFoundError: No module named 'demo_undeclared_dep'",
    ]
