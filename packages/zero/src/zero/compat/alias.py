"""Opt-in: serve ``import deepspeed`` from zero, for code that cannot be edited (libraries, launchers).

:func:`install_as_deepspeed` (in-process) and ``zero run --as-deepspeed`` (for the launched ranks) put two
things in a fresh temporary folder, never in site-packages, and put that folder first on the import path:

* ``deepspeed-<version>.dist-info/METADATA``: what ``importlib.metadata.version("deepspeed")`` reads
  (transformers' ``is_deepspeed_available()`` and Accelerate's version checks). The version is
  :data:`VERSION_SEEN` = ``0.19.8+zero.<zero version>``: the DeepSpeed release whose API zero mirrors, with a
  PEP 440 local label saying it is zero. ``Summary`` says the same. No distribution is installed: pip never sees
  it unless that folder is on its path.
* ``deepspeed/__init__.py``: a shim that, when a launched process imports it, installs the same import hook.

The import hook (a meta-path finder placed first) serves ``deepspeed`` as a small module that forwards every
attribute to ``zero`` (``deepspeed.__version__`` is :data:`VERSION_SEEN`), and ``deepspeed.X.Y`` as the module
``zero.as_deepspeed.X.Y`` itself, the façade of DeepSpeed's import paths (one module object under both names).

A real DeepSpeed that is importable makes both refuse (:class:`DeepSpeedPresentError`) unless forced: zero then
shadows it for this process (and the launched ranks) only.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path

import zero
from zero.compat.facade_paths import FacadeFinder
from zero.compat.unsupported import answer_deepspeed_paths

COMPAT_VERSION = "0.19.8"
"""The DeepSpeed release whose public API zero mirrors."""
VERSION_SEEN = f"{COMPAT_VERSION}+zero.{zero.__version__}"
"""The version other libraries read for ``deepspeed`` (metadata and ``deepspeed.__version__``)."""
ENV_DIR = "ZERO_AS_DEEPSPEED_DIR"
"""Environment variable naming the alias folder of the current run (set by install and ``zero run``)."""
CLI_FLAGS = {"--as-deepspeed": False, "--as-deepspeed-force": True}

_SHIM = '''"""Placed here by zero (``zero run --as-deepspeed`` / ``zero.install_as_deepspeed``): not DeepSpeed."""

from zero.compat.alias import serve_from_shim

serve_from_shim()
'''


class DeepSpeedPresentError(RuntimeError):
    """A real DeepSpeed is importable; zero refuses to shadow it unless forced."""


def real_deepspeed_origin(skip: str | None = None) -> str | None:
    """Where a real (not zero-served) ``deepspeed`` would be imported from, or None.

    Looks at ``sys.modules`` and searches ``sys.path`` without importing, passing over ``skip`` and every alias
    folder of zero's own (a ``deepspeed`` package that is :data:`_SHIM`: another run's ``python -m zero.compat``
    folder on ``PYTHONPATH``, as the README's Accelerate recipe puts it there).
    """
    mod = sys.modules.get("deepspeed")
    if mod is not None and not getattr(mod, "__zero_alias__", False) and not _is_shim(getattr(mod, "__file__", None)):
        return str(getattr(mod, "__file__", None) or mod)
    paths = [p for p in sys.path if skip is None or os.path.abspath(p or ".") != os.path.abspath(skip)]
    while paths:
        spec = importlib.machinery.PathFinder.find_spec("deepspeed", paths)
        if spec is None:
            return None
        origin = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
        if not _is_shim(origin):
            return str(origin)
        alias_root = os.path.abspath(Path(origin).parent.parent)  # zero's alias folder: look past it
        paths = [p for p in paths if os.path.abspath(p or ".") != alias_root]
    return None


def _is_shim(origin: str | None) -> bool:
    """Whether ``origin`` is the ``deepspeed/__init__.py`` of one of zero's alias folders."""
    if not origin or not str(origin).endswith("__init__.py"):
        return False
    try:
        return Path(origin).read_text() == _SHIM
    except OSError:
        return False


def _refuse_if_real(force: bool, skip: str | None = None) -> None:
    origin = real_deepspeed_origin(skip)
    if origin is not None and not force:
        raise DeepSpeedPresentError(
            f"a real DeepSpeed is importable ({origin}); zero will not shadow it. Uninstall it "
            "(pip uninstall deepspeed), or opt in explicitly with zero.install_as_deepspeed(force=True) / "
            "`zero run --as-deepspeed-force`, which serves `import deepspeed` from zero for this run only."
        )


def write_alias_dir(directory: str | os.PathLike | None = None) -> str:
    """Create the alias folder (metadata + shim, see the module docstring) in ``directory`` or a new temp folder;
    returns its path."""
    root = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="zero-as-deepspeed-"))
    info = root / f"deepspeed-{VERSION_SEEN}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: deepspeed\n"
        f"Version: {VERSION_SEEN}\n"
        f"Summary: zero {zero.__version__} serving the DeepSpeed {COMPAT_VERSION} API (not DeepSpeed; opt-in alias)\n"
    )
    (info / "top_level.txt").write_text("deepspeed\n")
    (root / "deepspeed").mkdir(exist_ok=True)
    (root / "deepspeed" / "__init__.py").write_text(_SHIM)
    return str(root)


def _proxy() -> types.ModuleType:
    """The module served as ``deepspeed``: its attributes are zero's; version and path are its own."""
    mod = types.ModuleType("deepspeed", "DeepSpeed's API served by zero (zero.install_as_deepspeed).")
    major, minor, patch = (int(x) for x in COMPAT_VERSION.split("."))
    spec = importlib.machinery.ModuleSpec("deepspeed", None, origin="zero (as deepspeed)", is_package=True)
    mod.__spec__ = spec  # find_spec("deepspeed") reads it once the module is imported
    mod.__dict__.update(
        __version__=VERSION_SEEN,
        __version_major__=major,
        __version_minor__=minor,
        __version_patch__=patch,
        __path__=[],
        __zero_alias__=True,
        __getattr__=lambda name: getattr(zero, name),
    )
    return mod


class _AliasFinder(FacadeFinder):
    """Serves ``deepspeed`` (the proxy) and ``deepspeed.X`` (= ``zero.as_deepspeed.X``) before any other finder."""

    def __init__(self):
        super().__init__("deepspeed")

    def find_spec(self, fullname, path, target=None):
        if fullname == "deepspeed":
            return importlib.machinery.ModuleSpec("deepspeed", self, origin="zero (as deepspeed)", is_package=True)
        return super().find_spec(fullname, path, target)

    def create_module(self, spec):
        return _proxy() if spec.loader_state is None else super().create_module(spec)


def _installed() -> _AliasFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _AliasFinder)), None)


def _forget_deepspeed_modules() -> None:
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]


def install_as_deepspeed(force: bool = False) -> str:
    """Serve ``import deepspeed`` from zero in this process and the processes it launches (opt-in).

    Writes the alias folder (module docstring; removed when this process exits), puts it first on ``sys.path`` and
    ``PYTHONPATH``, sets ``ZERO_AS_DEEPSPEED_DIR`` and installs the import hook. Idempotent.

    Args:
        force: shadow a real DeepSpeed that is importable (this process and its children only).

    Returns:
        the alias folder.

    Raises:
        DeepSpeedPresentError: a real DeepSpeed is importable and ``force`` is False (nothing was changed).
    """
    if _installed() is not None and os.environ.get(ENV_DIR):
        return os.environ[ENV_DIR]
    _refuse_if_real(force)
    directory = _temporary_alias_dir()
    _activate(directory)
    return directory


def _temporary_alias_dir() -> str:
    """A new alias folder that this process owns: removed when it exits, after the ranks it launched have (a
    launcher outlives its children); one folder per run otherwise piles up in the temp directory."""
    directory = write_alias_dir()
    atexit.register(shutil.rmtree, directory, True)
    return directory


def _activate(directory: str) -> None:
    mod = sys.modules.get("deepspeed")
    if mod is not None and not getattr(mod, "__zero_alias__", False):
        _forget_deepspeed_modules()  # forced over an already imported real DeepSpeed
    if directory not in sys.path:
        sys.path.insert(0, directory)
    old = os.environ.get("PYTHONPATH")
    if directory not in (old or "").split(os.pathsep):
        os.environ["PYTHONPATH"] = directory + (os.pathsep + old if old else "")
    os.environ[ENV_DIR] = directory
    _AliasFinder().install()
    answer_deepspeed_paths(True)
    importlib.invalidate_caches()


def uninstall_as_deepspeed() -> None:
    """Undo :func:`install_as_deepspeed` in this process (hook, path entries, modules, environment)."""
    directory = os.environ.pop(ENV_DIR, None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AliasFinder)]
    answer_deepspeed_paths(False)
    if directory is not None:
        sys.path[:] = [p for p in sys.path if p != directory]
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != directory]
        if parts:
            os.environ["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            os.environ.pop("PYTHONPATH", None)
    _forget_deepspeed_modules()
    importlib.invalidate_caches()


def serve_from_shim() -> None:
    """Run by the shim ``deepspeed/__init__.py`` in a launched process: install the hook, become the proxy."""
    shim = sys.modules["deepspeed"]  # the shim module, being executed
    _activate(str(Path(shim.__file__).resolve().parent.parent))
    sys.modules["deepspeed"] = _proxy()


def split_cli_flags(argv: list[str], anywhere: bool = False) -> tuple[list[str], bool | None]:
    """``zero run --as-deepspeed[-force] ...``: the flags leading ``argv`` or, with ``anywhere`` (``argv`` is the
    launcher options and the script only), wherever they are in it. Returns the rest of ``argv`` and None (no flag),
    False (``--as-deepspeed``) or True (``--as-deepspeed-force``)."""
    mode, rest = None, []
    for i, tok in enumerate(argv):
        if tok in CLI_FLAGS:
            mode = CLI_FLAGS[tok] or bool(mode)
        elif anywhere:
            rest.append(tok)
        else:
            return argv[i:], mode
    return rest, mode


def prepare_launch(force: bool) -> str:
    """For ``zero run --as-deepspeed``: refuse a real DeepSpeed unless ``force``, write the alias folder and put it
    first on ``PYTHONPATH`` for the launched ranks (the shim installs the hook there). Returns the folder, which is
    removed when this process exits.

    Raises:
        DeepSpeedPresentError: a real DeepSpeed is importable and ``force`` is False.
    """
    _refuse_if_real(force)
    directory = _temporary_alias_dir()
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = directory + (os.pathsep + old if old else "")
    os.environ[ENV_DIR] = directory
    return directory


def main(argv: list[str] | None = None) -> int:
    """``python -m zero.compat [--force]``: write an alias folder and print its path, for launchers zero does not
    wrap (``PYTHONPATH=$(python -m zero.compat):$PYTHONPATH accelerate launch --use_deepspeed ...``).

    Returns 0, or 1 (with the reason on stderr) when a real DeepSpeed is importable and ``--force`` is not given.
    """
    args = sys.argv[1:] if argv is None else argv
    try:
        _refuse_if_real("--force" in args)
    except DeepSpeedPresentError as e:
        print(f"zero.compat.alias: {e}", file=sys.stderr)
        return 1
    print(write_alias_dir())
    return 0
