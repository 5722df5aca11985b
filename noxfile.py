"""Every workflow of the zero monorepo: tests, unit, lint, isolation, demo, bench.

Every install goes through ``constraints.txt`` (torch pinned to the CPU wheel on disk). Virtual environments are
reused between runs, and a stamp of the project files decides whether packages are reinstalled, so a second
``nox -s tests`` does not reinstall torch. The isolation venvs are the exception: each is built fresh and deleted.
"""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import tomllib

import nox
from packaging.requirements import Requirement

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints.txt"
# Bottom of the layering first.
PACKAGES = ["zero-comm", "zero-kernels", "zero-profiler", "zero-core", "zero-offload", "zero-compile", "zero"]
PYTEST_DEPS = ["pytest>=7", "pytest-timeout>=2"]
# Only the meta-package's tests (and tests-integration) import these; the other packages' isolation venvs skip them.
ZERO_TEST_DEPS = ["tensorboard>=2.14", "wandb>=0.16"]  # zero's monitor extras, read back by test_monitors
ZERO_TEST_DEPS += ["accelerate>=1.0"]  # zero's DeepSpeed-compatibility tests (Accelerate on zero)
ZERO_TEST_DEPS += ["peft>=0.17"]  # PEFT's parameter count of a LoRA model at ZeRO-3 (ds_numel)
ZERO_TEST_DEPS += ["scikit-learn>=1.3"]  # zero[autotune]'s model-based tuner tests
TEST_DEPS = PYTEST_DEPS + ZERO_TEST_DEPS
# A dropped connection mid-download failed a CI run: let pip retry and resume harder than its defaults (5).
PIP_ENV = {"PIP_RETRIES": "10", "PIP_RESUME_RETRIES": "20"}


def _pyproject(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


def _local_closure(package: str) -> list[str]:
    """The package and every zero sibling it declares, transitively (siblings are not on PyPI)."""
    seen: list[str] = []
    todo = [package]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        for dep in _pyproject(name)["project"].get("dependencies", []):
            dep_name = Requirement(dep).name
            if dep_name in PACKAGES:
                todo.append(dep_name)
    return [p for p in PACKAGES if p in seen]


def _install(session: nox.Session, packages: list[str], extra: list[str], editable: bool = True) -> None:
    """Install local packages (and extra requirements) unless the venv's stamp says this exact set is in place."""
    digest = hashlib.sha256(" ".join(packages + extra + [str(editable)]).encode())
    files = [CONSTRAINTS] + [ROOT / "packages" / p / "pyproject.toml" for p in packages]
    if not editable:  # a copied install goes stale when any source file changes
        files += sorted(f for p in packages for f in (ROOT / "packages" / p / "src").rglob("*") if f.is_file())
    for f in files:
        digest.update(str(f).encode() + f.read_bytes())
    stamp = pathlib.Path(session.virtualenv.location) / ".zero-install-stamp"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        session.log("packages already installed from these files; skipping install")
        return
    stamp.unlink(missing_ok=True)
    args = ["-c", str(CONSTRAINTS)]
    for p in packages:
        path = str(ROOT / "packages" / p)
        args += ["-e", path] if editable else [path]
    session.install(*args, *extra, env=PIP_ENV)
    stamp.write_text(digest.hexdigest())


def _install_all(session: nox.Session, extra: list[str] = ()) -> None:
    _install(session, PACKAGES, TEST_DEPS + list(extra))


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's unit tests and the cross-package tests in tests-integration/; non-zero exit on failure."""
    _install_all(session)
    targets = [f"packages/{p}/tests" for p in PACKAGES] + ["tests-integration"]
    session.run("pytest", *targets, *session.posargs)


@nox.session
@nox.parametrize("package", PACKAGES)
def unit(session: nox.Session, package: str) -> None:
    """One package's unit tests (all packages installed editable)."""
    _install_all(session)
    session.run("pytest", f"packages/{package}/tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree (config in the root pyproject.toml)."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
@nox.parametrize("package", PACKAGES)
def isolation(session: nox.Session, package: str) -> None:
    """Install one package alone (plus only the zero siblings it declares), import it, run its unit tests.

    Proves that each piece installs by itself and leans on no undeclared sibling: the venv is checked to hold
    no other zero package. Each venv (about 1.4 GB, mostly torch) is built fresh and deleted when its session
    ends, so the seven sessions never hold more than one on disk (a CI machine ran out of space with all seven).
    """
    venv = pathlib.Path(session.virtualenv.location)
    try:
        _isolation(session, package)
    finally:
        shutil.rmtree(venv, ignore_errors=True)


def _isolation(session: nox.Session, package: str) -> None:
    closure = _local_closure(package)
    _install(session, closure, TEST_DEPS if package == "zero" else PYTEST_DEPS, editable=False)
    allowed = {p.replace("-", "_") for p in closure}
    module = _pyproject(package)["project"]["name"].replace("-", "_")
    check = (
        "import importlib.metadata as md, sys\n"
        f"allowed = {sorted(allowed)!r}\n"
        "names = {d.metadata['Name'].replace('-', '_').lower() for d in md.distributions()}\n"
        "present = {n for n in names if n == 'zero' or n.startswith('zero_')}\n"
        "extra = present - set(allowed)\n"
        "assert not extra, f'undeclared zero packages in the venv: {sorted(extra)}'\n"
        f"import {module}\n"
        f"print('{module}', {module}.__version__, 'installed with', sorted(present))\n"
    )
    session.run("python", "-c", check)
    # Run from the package folder against the installed (non-editable) copy.
    session.run("pytest", str(ROOT / "packages" / package / "tests"), "--rootdir", str(ROOT), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: `zero train` with its embedded defaults (2 ranks, ZeRO-3, Llama on the stdlib's source)."""
    _install_all(session)
    session.run("zero", "train", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against peers measured in the same run; writes docs/benchmarks.md. `-- --quick` for quick mode."""
    _install_all(session, ["deepspeed==0.19.8"])
    # DeepSpeed JIT-builds ops on first use (its shm comm op takes ~55 s here): cache them between runs.
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ROOT / ".nox" / "torch_extensions")}
    session.run("python", "benchmarks/run_all.py", *session.posargs, env=env)
