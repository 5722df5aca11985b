"""Every workflow of the zero monorepo: tests, unit, lint, build, isolation, compat, release, gpu, demo, bench.

Every install goes through ``constraints.txt`` (torch pinned to the CPU wheel on disk). Virtual environments are
reused between runs, and a stamp of the project files decides whether packages are reinstalled, so a second
``nox -s tests`` does not reinstall torch. The isolation venv is reused too: between packages it drops everything but
its base (torch and pytest).
Release machinery (versions, wheels, the compatibility matrix): docs/releasing.md.
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import shutil
import subprocess
import tempfile
import tomllib

import nox
from packaging.requirements import Requirement
from packaging.version import Version

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

ROOT = pathlib.Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints.txt"
DIST = ROOT / "dist"  # nox -s build: the sdist and wheel of every package of this tree
RELEASES = ROOT / "releases.toml"  # every release: package, version, commit (tags are optional, never read)
RELEASE_WHEELS = ROOT / ".nox" / "release-wheels"  # wheels of recorded releases, built by compat from their commit
GPU_WHEELHOUSE = DIST / "gpu-wheelhouse"  # what `nox -s gpu` carries to a GPU machine (gpu/run.py installs it)
# What a bare CUDA machine (CUDA torch, transformers, numpy, safetensors there) lacks: the versions tested here.
GPU_EXTRA_WHEELS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
                    "typing-extensions==4.16.0"]  # fmt: skip
# DeepSpeed for the peers' GPU checks (gpu/peers.py, gpu/capacity.py): a pure-Python wheel built here from its sdist
# (DS_BUILD_OPS=0: its ops are built just in time on the GPU machine), and what `import deepspeed` and its op builds
# need beyond that machine's torch, transformers (packaging, tqdm, numpy) and the pydantic above; scipy (35 MB, the
# largest wheel carried) for DeepCompile's default schedule, whose prefetch pass interpolates with it.
GPU_DEEPSPEED = "deepspeed==0.19.8"
GPU_DEEPSPEED_DEPS = ["einops==0.8.2", "hjson==3.1.0", "msgpack==1.2.4", "ninja==1.13.2", "psutil==7.2.2",
                      "py-cpuinfo==9.0.0", "scipy==1.17.1"]  # fmt: skip
# Tools of the release sessions; versions pinned in constraints.txt.
BUILD_TOOLS = ["build", "twine", "check-wheel-contents"]
# Bottom of the layering first.
PACKAGES = ["zero-comm", "zero-kernels", "zero-profiler", "zero-core", "zero-parallel", "zero-inference",
            "zero-offload", "zero-compile", "zero"]  # fmt: skip
PYTEST_DEPS = ["pytest>=7", "pytest-timeout>=2"]
# Only the meta-package's tests (and tests-integration) import these.
ZERO_TEST_DEPS = ["tensorboard>=2.14", "wandb>=0.16"]  # zero's monitor extras, read back by test_monitors
ZERO_TEST_DEPS += ["accelerate>=1.0"]  # zero's DeepSpeed-compatibility tests (Accelerate on zero)
ZERO_TEST_DEPS += ["peft>=0.17"]  # PEFT's parameter count of a LoRA model at ZeRO-3 (ds_numel)
ZERO_TEST_DEPS += ["trl>=1.0"]  # TRL's SFTTrainer and DPOTrainer (reference model) on zero: test_trl_trainers.py
ZERO_TEST_DEPS += ["scikit-learn>=1.3"]  # zero[autotune]'s model-based tuner tests
ZERO_TEST_DEPS += ["griffe>=2"]  # tests-integration/test_api_check.py: the release API check (tools/api_check.py)
TEST_DEPS = PYTEST_DEPS + ZERO_TEST_DEPS
# What each package's unit tests need beyond its own dependencies, in compat (pytest by default).
PACKAGE_TEST_DEPS = {"zero": TEST_DEPS, "zero-parallel": PYTEST_DEPS + ["transformers>=4.51"],
                     "zero-inference": PYTEST_DEPS + ["transformers>=4.51"]}  # fmt: skip
# What `isolation` installs beside a package for its smoke tests, beyond pytest (its declared dependencies aside).
ISOLATION_TEST_DEPS = {"zero-parallel": ["transformers>=4.51"], "zero-inference": ["transformers>=4.51"]}
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


def _install(session: nox.Session, packages: list[str], extra: list[str]) -> None:
    """Install local packages editable (and extra requirements) unless the venv's stamp says this set is in place."""
    digest = hashlib.sha256(" ".join(packages + extra).encode())
    for f in [CONSTRAINTS] + [ROOT / "packages" / p / "pyproject.toml" for p in packages]:
        digest.update(str(f).encode() + f.read_bytes())
    stamp = pathlib.Path(session.virtualenv.location) / ".zero-install-stamp"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        session.log("packages already installed from these files; skipping install")
        return
    stamp.unlink(missing_ok=True)
    args = ["-c", str(CONSTRAINTS)]
    for p in packages:
        args += ["-e", str(ROOT / "packages" / p)]
    session.log(f"installing {len(packages)} zero packages and their dependencies into {session.virtualenv.location} "
                "(the first time takes minutes: torch alone is a large download); pip's progress follows")  # fmt: skip
    session.install(*args, *extra, env=PIP_ENV, silent=False)
    stamp.write_text(digest.hexdigest())


def _install_all(session: nox.Session, extra: list[str] = ()) -> None:
    _install(session, PACKAGES, TEST_DEPS + list(extra))


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's unit tests and the cross-package tests in tests-integration/; non-zero exit on failure."""
    _install_all(session)
    targets = [f"packages/{p}/tests" for p in PACKAGES] + ["tests-integration"]
    session.run("pytest", *targets, "--durations=40", *session.posargs)  # the slowest are where CI's time goes


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


def _version(package: str) -> str:
    return _pyproject(package)["project"]["version"]


def _source_files(package: str) -> list[pathlib.Path]:
    """What a build of the package reads: its metadata, README, setup.py and src/ (no caches, no built objects)."""
    base = ROOT / "packages" / package
    files = [base / n for n in ("pyproject.toml", "README.md", "setup.py") if (base / n).exists()]
    skip = (".pyc", ".so")
    files += sorted(
        f for f in (base / "src").rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and ".egg-info" not in str(f) and f.suffix not in skip
    )  # fmt: skip
    return files


def _source_digest(package: str) -> str:
    digest = hashlib.sha256()
    for f in _source_files(package):
        digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def _wheel(package: str, folder: pathlib.Path = DIST, version: str | None = None) -> pathlib.Path:
    """The wheel of ``package`` at ``version`` (default: this tree's) in ``folder``."""
    version = version or _version(package)
    found = sorted(folder.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"no wheel of {package} {version} in {folder}: run `nox -s build` first")
    return found[0]


def _current_wheels(session: nox.Session, packages: list[str]) -> list[pathlib.Path]:
    """The wheels in dist/ of ``packages``, refusing a dist/ built from other sources than this tree's."""
    stamp = DIST / "BUILT_FROM.toml"
    built = tomllib.loads(stamp.read_text()) if stamp.exists() else {}
    stale = [p for p in packages if built.get(p) != _source_digest(p)]
    if stale:
        session.error(f"dist/ does not hold wheels of this tree's {', '.join(stale)}: run `nox -s build` first")
    return [_wheel(p) for p in packages]


def _check_dists(session: nox.Session) -> None:
    """Our own checks of every sdist and wheel, beside twine's and check-wheel-contents'."""
    import tarfile
    import zipfile
    from email.parser import Parser

    problems = []
    for package in PACKAGES:
        module, version = package.replace("-", "_"), _version(package)
        wheel = _wheel(package)
        names = zipfile.ZipFile(wheel).namelist()
        dist_info = f"{module}-{version}.dist-info/"
        for n in names:
            top = n.split("/")[0]
            if top not in (module, dist_info.rstrip("/")):
                problems.append(f"{wheel.name}: {n} lies outside the package ({module}/)")
            if "/tests/" in f"/{n}" or n.endswith("conftest.py") or "/test_" in n:
                problems.append(f"{wheel.name}: test file {n}")
            if "__pycache__" in n or n.endswith((".pyc", ".so", ".o")) or ".egg-info" in n:
                problems.append(f"{wheel.name}: stray build file {n}")
        meta = Parser().parsestr(zipfile.ZipFile(wheel).read(dist_info + "METADATA").decode())
        for field in ("Name", "Version", "Summary", "Requires-Python", "Description-Content-Type"):
            if not meta.get(field):
                problems.append(f"{wheel.name}: METADATA lacks {field}")
        if not (meta.get("License") or meta.get("License-Expression")):
            problems.append(f"{wheel.name}: METADATA names no license")
        if meta.get("Version") != version or len(meta.get_payload() or "") < 200:
            problems.append(f"{wheel.name}: METADATA version {meta.get('Version')} or its README body is wrong")
        for req in map(Requirement, meta.get_all("Requires-Dist") or []):
            ops = {s.operator for s in req.specifier}
            if req.name in PACKAGES and not ({">=", "<"} <= ops):
                problems.append(f"{wheel.name}: sibling requirement {req} needs a lower and an upper bound")
        if package == "zero-kernels":  # the ops build just in time from the installed sources
            csrc = ROOT / "packages" / package / "src" / module / "csrc"
            want = {f"{module}/csrc/{f.relative_to(csrc).as_posix()}" for f in csrc.rglob("*") if f.is_file()}
            missing = sorted(want - set(names))
            if missing or not any(n.endswith(".cu") for n in names):
                problems.append(f"{wheel.name}: C++/CUDA sources missing: {missing}")
        sdist = DIST / f"{module}-{version}.tar.gz"
        members = {m.split("/", 1)[-1] for m in tarfile.open(sdist).getnames()}
        for need in ("pyproject.toml", "README.md", "PKG-INFO", f"src/{module}/__init__.py"):
            if need not in members:
                problems.append(f"{sdist.name}: lacks {need}")
    if problems:
        session.error("distribution check failed:\n  " + "\n  ".join(problems))
    session.log(f"our checks passed on {2 * len(PACKAGES)} distributions")


def _build_requires() -> list[str]:
    """Every package's declared build requirements: the build venv holds them, so `python -m build --no-isolation`
    (one venv instead of two per package: minutes less on 2 cores) builds with what is declared."""
    return sorted({r for p in PACKAGES for r in _pyproject(p)["build-system"]["requires"]})


@nox.session
def build(session: nox.Session) -> None:
    """sdist and wheel of every package (`python -m build`: the wheel is built from the sdist) into dist/, checked.

    The build venv holds the union of the packages' declared build requirements (`--no-isolation`).

    Checks: `twine check --strict` (metadata and README render), `check-wheel-contents` (no .pyc, no duplicates, no
    stray top-level names), and ours: no tests or build leftovers in a wheel, metadata complete, sibling
    requirements bounded above and below, zero-kernels' C++/CUDA sources inside its wheel. dist/BUILT_FROM.toml
    records which sources were built, so `isolation` and `compat` refuse a stale dist/.
    """
    session.install("-c", str(CONSTRAINTS), *BUILD_TOOLS, *_build_requires(), env=PIP_ENV)
    shutil.rmtree(DIST, ignore_errors=True)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(DIST), str(ROOT / "packages" / package))
    session.run("twine", "check", "--strict", *map(str, sorted(DIST.glob("*"))))
    session.run("check-wheel-contents", *map(str, sorted(DIST.glob("*.whl"))))
    _check_dists(session)
    (DIST / "BUILT_FROM.toml").write_text("".join(f'"{p}" = "{_source_digest(p)}"\n' for p in PACKAGES))


def _assert_only(session: nox.Session, package: str, allowed: list[str]) -> None:
    """Import ``package`` from the venv and check no zero package beyond ``allowed`` is installed."""
    module = package.replace("-", "_")
    check = (
        "import importlib.metadata as md, sys\n"
        f"allowed = {sorted(p.replace('-', '_') for p in allowed)!r}\n"
        "names = {d.metadata['Name'].replace('-', '_').lower(): d.version for d in md.distributions()}\n"
        "present = {n: v for n, v in names.items() if n == 'zero' or n.startswith('zero_')}\n"
        "extra = set(present) - set(allowed)\n"
        "assert not extra, f'undeclared zero packages in the venv: {sorted(extra)}'\n"
        f"import {module}\n"
        f"assert '{ROOT}/packages' not in {module}.__file__, {module}.__file__  # the installed copy, not the tree\n"
        f"print('{module}', {module}.__version__, 'installed with', sorted(present.items()))\n"
    )
    session.run("python", "-c", check)


def _installed(session: nox.Session) -> set[str]:
    """The distributions in the session's venv, by normalised name."""
    import json

    out = session.run("python", "-m", "pip", "list", "--format=json", silent=True, log=False)
    return {re.sub(r"[-_.]+", "-", d["name"]).lower() for d in json.loads(out[out.index("[") :])}


# What the isolation venv keeps between packages: these and everything they require.
ISOLATION_BASE = ["torch", "pytest", "pytest-timeout", "pip", "setuptools", "wheel"]
_REQUIRED_CLOSURE = """
import importlib.metadata as md, json, re, sys
from packaging.requirements import Requirement
seen, todo = set(), list(sys.argv[1:])
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in seen:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    seen.add(name)
    for r in dist.requires or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
print(json.dumps(sorted(seen)))
"""


def _base(session: nox.Session) -> set[str]:
    """``ISOLATION_BASE`` and every distribution it requires, as installed in the session's venv."""
    import json

    out = session.run("python", "-c", _REQUIRED_CLOSURE, *ISOLATION_BASE, silent=True, log=False)
    return set(json.loads(out.strip().splitlines()[-1]))


def _uninstall_beyond(session: nox.Session, base: set[str]) -> None:
    """Uninstall every distribution the venv holds beyond ``base``."""
    extra = sorted(_installed(session) - base)
    if extra:
        session.run("python", "-m", "pip", "uninstall", "-y", "-q", *extra, silent=True)


def _smoke_files(package: str) -> list[str]:
    """The test files of ``package`` holding tests marked ``@pytest.mark.smoke``."""
    tests = ROOT / "packages" / package / "tests"
    return sorted(str(f) for f in tests.rglob("test_*.py") if "mark.smoke" in f.read_text())


@nox.session
def isolation(session: nox.Session) -> None:
    """What only an install from the wheel shows, for each package (`-- PACKAGE ...`: those only).

    One venv holds the base every install starts from: torch (through constraints.txt) and pytest. For each package
    in turn, everything beyond that base is uninstalled, then the package is installed from its wheel in dist/ by
    name, as the README says (`pip install --find-links dist zero-comm==VERSION`), which brings only the zero
    siblings it declares (also from dist/) and its declared dependencies. Then:

    - the venv is checked to hold no zero package beyond the declared ones, and the package imports from
      site-packages, not the tree;
    - `tools/isolation_check.py`: its installed files equal src/ byte for byte, every module imports, its console
      scripts run (`zero --help`);
    - zero-kernels builds and runs its CPU Adam op from the installed wheel's sources (`tools/wheel_op_check.py`);
    - its smoke tests (`@pytest.mark.smoke`: a handful per package, chosen to touch what an install can break:
      package data, the CLI, spawned ranks importing the installed code) run against the installed copy.

    The full unit suites run in `nox -s tests` on the same code; `compat` runs them against older siblings. Uninstalling
    between packages instead of a fresh venv each saves installing torch eight times. Needs `nox -s build` first.
    """
    chosen = session.posargs or PACKAGES
    unknown = sorted(set(chosen) - set(PACKAGES))
    if unknown:
        session.error(f"isolation: unknown package(s) {unknown}; choose from {PACKAGES}")
    _current_wheels(session, sorted({p for c in chosen for p in _local_closure(c)}))
    session.install("-c", str(CONSTRAINTS), "torch", *PYTEST_DEPS, env=PIP_ENV)
    base = _base(session)  # not what is installed: a reused venv may hold a package an aborted run left
    venv = pathlib.Path(session.virtualenv.location)
    for package in chosen:
        session.log(f"isolation: {package}")
        _uninstall_beyond(session, base)
        closure = _local_closure(package)
        wanted = f"{package}=={_version(package)}"
        deps = ISOLATION_TEST_DEPS.get(package, [])
        session.install("-c", str(CONSTRAINTS), "--find-links", str(DIST), wanted, *deps, env=PIP_ENV)
        _assert_only(session, package, closure)
        session.run("python", str(ROOT / "tools" / "isolation_check.py"), package)
        if package == "zero-kernels":
            cache = venv / "zero-kernels-cache"  # empty: the op is built now, from the wheel's sources
            shutil.rmtree(cache, ignore_errors=True)
            session.run("python", str(ROOT / "tools" / "wheel_op_check.py"), env={"ZERO_KERNELS_CACHE": str(cache)})
        smoke = _smoke_files(package)
        if not smoke:
            session.error(f"isolation: {package} has no test marked @pytest.mark.smoke")
        # from the root (its pytest settings), against the installed (non-editable) copy
        session.run("pytest", *smoke, "-m", "smoke", "--rootdir", str(ROOT), "--durations=5")
    _uninstall_beyond(session, base)


def _releases() -> dict[str, list[tuple[Version, str]]]:
    """releases.toml: package -> [(version, commit)], oldest first."""
    out: dict[str, list[tuple[Version, str]]] = {p: [] for p in PACKAGES}
    for entry in tomllib.loads(RELEASES.read_text()).get("release", []):
        out[entry["package"]].append((Version(entry["version"]), entry["commit"]))
    return {p: sorted(v) for p, v in out.items()}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def _export(session: nox.Session, package: str, commit: str, into: pathlib.Path) -> pathlib.Path:
    """packages/<package> as it was at ``commit``, unpacked under ``into`` (git archive: no tag, no worktree)."""
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"]).returncode != 0:
        session.error(f"releases.toml: commit {commit} of {package} is not in this clone (a shallow clone? fetch it)")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, f"packages/{package}"],
        check=True,
        capture_output=True,
    ).stdout
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "packages" / package


def _release_wheel(session: nox.Session, package: str, version: Version, commit: str) -> pathlib.Path:
    """The wheel of a recorded release, built once from its commit into .nox/release-wheels/ and kept."""
    try:
        return _wheel(package, RELEASE_WHEELS, str(version))
    except RuntimeError:
        pass
    RELEASE_WHEELS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = _export(session, package, commit, pathlib.Path(tmp))
        session.run("python", "-m", "build", "--no-isolation", "--wheel", "--outdir", str(RELEASE_WHEELS), str(src))
    wheel = _wheel(package, RELEASE_WHEELS, str(version))  # raises if the commit holds another version
    return wheel


def _same_tree(package: str, commit: str) -> bool:
    """Whether packages/<package> of the working tree is exactly what it was at ``commit``."""
    if _git("status", "--porcelain", "--", f"packages/{package}"):
        return False
    return _git("rev-parse", f"{commit}:packages/{package}") == _git("rev-parse", f"HEAD:packages/{package}")


def _oldest_siblings(package: str, releases: dict) -> dict[str, tuple[Version, str | None]]:
    """Every zero sibling of ``package`` (transitively) at the oldest recorded release that all of this tree's
    declared ranges on it allow. A sibling never released has only this tree's version to test with: it comes back
    as (this tree's version, None), and its wheel is this tree's (docs/releasing.md, "A new package")."""
    specs: dict[str, list] = {}
    for p in _local_closure(package):
        for dep in map(Requirement, _pyproject(p)["project"].get("dependencies", [])):
            if dep.name in PACKAGES:
                specs.setdefault(dep.name, []).append(dep.specifier)
    chosen = {}
    for sibling, spec_list in specs.items():
        if not releases[sibling]:
            version = Version(_version(sibling))
            if not all(version in s for s in spec_list):
                raise RuntimeError(f"unreleased {sibling} {version} is outside {[str(s) for s in spec_list]}")
            chosen[sibling] = (version, None)
            continue
        allowed = [(v, c) for v, c in releases[sibling] if all(v in s for s in spec_list)]
        if not allowed:
            raise RuntimeError(f"no recorded release of {sibling} satisfies {[str(s) for s in spec_list]}")
        chosen[sibling] = allowed[0]
    return chosen


@nox.session
def compat(session: nox.Session) -> None:
    """The compatibility matrix (oldest allowed siblings) and the public-API check against the last release.

    1. API: each package's public names (its `__all__`, docs/releasing.md) against its last release in
       releases.toml, with griffe; fails on a break no `changes/*.breaking.md` fragment announces.
    2. Matrix, trimmed to one row per package: this tree's package (wheel from dist/) with every zero sibling at
       the oldest release its ranges allow, each built from the commit releases.toml records (git archive; tags
       are never needed), then its unit tests. A row whose siblings are all identical to this tree's (same git
       tree) is the combination `tests` already runs, and is not run twice. `-- --all` runs every row;
       `-- PACKAGE ...` limits both parts to those packages.
    """
    session.install("-c", str(CONSTRAINTS), "build", "griffe", *_build_requires(), *PYTEST_DEPS, env=PIP_ENV)
    args = [a for a in session.posargs if a != "--all"]
    chosen = [p for p in PACKAGES if not args or p in args]
    releases = _releases()
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for package in chosen:
            if not releases[package]:
                session.log(f"{package}: no release recorded yet; no API to compare against")
                continue
            version, commit = releases[package][-1]
            old = _export(session, package, commit, pathlib.Path(tmp) / f"{package}-{version}")
            new = ROOT / "packages" / package
            try:
                session.run("python", str(ROOT / "tools" / "api_check.py"), package, str(old / "src"),
                            str(new / "src"), str(new / "changes"))  # fmt: skip
            except nox.command.CommandFailed:
                failures.append(f"{package}: public API broken against {version} (see above)")
    for package in chosen:
        siblings = _oldest_siblings(package, releases)
        if not siblings:
            continue
        row = ", ".join(
            f"{s} {v}" + (" (unreleased: this tree's)" if c is None else "") for s, (v, c) in siblings.items()
        )
        if "--all" not in session.posargs and all(c is None or _same_tree(s, c) for s, (_, c) in siblings.items()):
            session.log(f"{package}: oldest allowed siblings ({row}) are this tree's own: covered by tests")
            continue
        session.log(f"{package} {_version(package)} with {row}")
        wheels = [_current_wheels(session, [package])[0]]
        wheels += [_current_wheels(session, [s])[0] if c is None else _release_wheel(session, s, v, c)
                   for s, (v, c) in siblings.items()]  # fmt: skip
        session.run("python", "-m", "pip", "uninstall", "-y", "-q", *PACKAGES, silent=True)
        deps = PACKAGE_TEST_DEPS.get(package, [])
        session.install("-c", str(CONSTRAINTS), *map(str, wheels), *deps, env=PIP_ENV)
        _assert_only(session, package, [package, *siblings])
        try:
            session.run("pytest", str(ROOT / "packages" / package / "tests"), "--rootdir", str(ROOT), "-x")
        except nox.command.CommandFailed:
            failures.append(f"{package} {_version(package)} fails its unit tests with {row}")
    if failures:
        session.error("compat failed:\n  " + "\n  ".join(failures))


@nox.session
def release(session: nox.Session) -> None:
    """Cut a release: `-- PACKAGE VERSION` writes VERSION into the package's pyproject.toml and turns its changes/
    fragments into CHANGELOG.md (towncrier); commit that, then `-- --record` appends every package whose version
    is not yet recorded to releases.toml at HEAD's commit (commit that too). docs/releasing.md has the policy."""
    session.install("-c", str(CONSTRAINTS), "towncrier", env=PIP_ENV)
    if session.posargs == ["--record"]:
        if _git("status", "--porcelain", "--", "packages"):
            session.error("packages/ has uncommitted changes: commit the release first, then record it")
        head, releases, lines = _git("rev-parse", "HEAD"), _releases(), []
        for package in PACKAGES:
            version = Version(_version(package))
            if all(v != version for v, _ in releases[package]):
                lines.append(f'\n[[release]]\npackage = "{package}"\nversion = "{version}"\ncommit = "{head}"\n')
        RELEASES.write_text(RELEASES.read_text() + "".join(lines))
        session.log(f"recorded {len(lines)} release(s) at {head}")
        return
    if len(session.posargs) != 2 or session.posargs[0] not in PACKAGES:
        session.error(f"usage: nox -s release -- PACKAGE VERSION (PACKAGE in {PACKAGES}), or -- --record")
    package, version = session.posargs[0], str(Version(session.posargs[1]))
    pyproject = ROOT / "packages" / package / "pyproject.toml"
    text = pyproject.read_text()
    old = f'version = "{_version(package)}"'
    pyproject.write_text(text.replace(old, f'version = "{version}"', 1))
    with session.chdir(ROOT / "packages" / package):
        session.run("towncrier", "build", "--yes", "--version", version)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Every GPU check in one run with one report (gpu/run.py: CUDA ops and their tests, parity of stages 0-3,
    offload and compiled ZeRO-3 against the CPU, zero against DeepSpeed and FSDP2, model capacity, comm streams,
    kernel bandwidth). Runs with the python3 on PATH, which on a GPU machine holds its CUDA torch; without a GPU it
    says so and exits 0.

    `-- --prepare` (needs `nox -s build` and the internet) fills dist/gpu-wheelhouse with our wheels and what a
    bare CUDA machine lacks (pydantic, DeepSpeed 0.19.8 as a pure-Python wheel and its dependencies), for CPython
    3.12 on x86-64 Linux; `-- --dry-run` lists the checks and those wheels.
    Other arguments go to gpu/run.py (`--report PATH`, `--only NAME,...`).
    """
    args = list(session.posargs)
    if "--prepare" in args:
        args.remove("--prepare")
        shutil.rmtree(GPU_WHEELHOUSE, ignore_errors=True)
        GPU_WHEELHOUSE.mkdir(parents=True)
        for wheel in _current_wheels(session, PACKAGES):
            shutil.copy2(wheel, GPU_WHEELHOUSE)
        platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64"]
        target = ["--python-version=3.12", "--implementation=cp", *platforms, "-d", str(GPU_WHEELHOUSE)]
        session.run("python3", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *target, *GPU_EXTRA_WHEELS,
                    *GPU_DEEPSPEED_DEPS, env=PIP_ENV)  # fmt: skip
        session.run("python3", "-m", "pip", "wheel", "--no-deps", "-w", str(GPU_WHEELHOUSE), GPU_DEEPSPEED,
                    env={**PIP_ENV, "DS_BUILD_OPS": "0"})  # fmt: skip
        if not args:
            args = ["--dry-run"]
    session.run("python3", str(ROOT / "gpu" / "run.py"), *args)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: `zero train` with its embedded defaults (2 ranks, ZeRO-3, Llama on the stdlib's source).
    Installs what the packages declare and nothing of the test suite's (a new user's first command)."""
    _install(session, PACKAGES, [])
    session.run("zero", "train", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against peers measured in the same run; writes docs/benchmarks.md. `-- --quick` for quick mode."""
    _install_all(session, ["deepspeed==0.19.8"])
    # DeepSpeed JIT-builds ops on first use (its shm comm op takes ~55 s here): cache them between runs.
    env = {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": str(ROOT / ".nox" / "torch_extensions")}
    session.run("python", "benchmarks/run_all.py", *session.posargs, env=env)
