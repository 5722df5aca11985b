"""Op loader: a prebuilt extension when the package was installed with ops, else a just-in-time build into a cache.

``load(name)`` resolves an op in this order:

1. the module already loaded in this process;
2. the prebuilt module ``zero_kernels._op_<name>`` (built at install time with ``ZERO_BUILD_OPS=1``), used only if
   the source hash it was built from equals the hash of the sources installed now;
3. the cache directory ``<root>/<torch version>/<name>-<hash>`` where ``<root>`` is ``$ZERO_KERNELS_CACHE`` or
   ``~/.cache/zero_kernels``, imported directly when its build finished (no lock, no ninja run);
4. a build with ninja through ``torch.utils.cpp_extension.load`` into a fresh temporary directory that is renamed
   to the cache directory when the build succeeds. One process builds while others wait on an ``flock`` (released by
   the kernel if the builder dies, so a killed builder never blocks later runs); the wait is bounded by
   ``$ZERO_KERNELS_LOCK_TIMEOUT`` seconds (default 600) and the error names the lock file.

The hash covers the op's sources, headers and flags, so editing a source rebuilds and nothing else does.
Mirrors DeepSpeed's ``op_builder`` (prebuilt via ``DS_BUILD_OPS=1`` else JIT), without its lock that never expires.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

from zero_kernels._filelock import FileLock
from zero_kernels.ops import CSRC, OPS, OpSpec

_COMPLETE = ".complete"


class BuildError(RuntimeError):
    """An op could not be built or imported; the message carries the compiler's output or the missing tool."""


_loaded: dict[str, ModuleType] = {}
_failed: dict[str, BuildError] = {}
_resolved: dict[str, ModuleType | None] = {}


def _log(msg: str) -> None:
    print(f"zero_kernels: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """``$ZERO_KERNELS_CACHE`` or ``~/.cache/zero_kernels``, then a folder per torch version."""
    import torch

    root = os.environ.get("ZERO_KERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "zero_kernels")
    return Path(root) / torch.__version__.replace("+", "_")


def _spec(name: str | OpSpec) -> OpSpec:
    if isinstance(name, OpSpec):
        return name
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"zero_kernels.load: unknown op {name!r}; known ops: {sorted(OPS)}") from None


def _import_file(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prebuilt(spec: OpSpec, digest: str) -> ModuleType | None:
    name = spec.prebuilt_module or f"zero_kernels._op_{spec.name}"
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    if getattr(module, "source_hash", None) != digest:
        _log(f"prebuilt {name} was built from other sources than these (hash mismatch); building just in time")
        return None
    return module


def _check_toolchain(spec: OpSpec) -> None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"cannot build op {spec.name!r}: C++ compiler {cxx!r} not found (set CXX or install g++)")
    if shutil.which("ninja") is None:
        raise BuildError(f"cannot build op {spec.name!r}: ninja not found on PATH (pip install ninja)")
    if spec.cuda:
        import torch
        from torch.utils import cpp_extension

        if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
            raise BuildError(
                f"cannot build op {spec.name!r}: it needs CUDA, but torch {torch.__version__} has CUDA "
                f"{torch.version.cuda} and CUDA_HOME is {cpp_extension.CUDA_HOME}"
            )


def _remove_dead_tmp_dirs(parent: Path, prefix: str) -> None:
    """Remove ``<prefix>.tmp-<pid>`` build folders whose builder process is gone."""
    for tmp in parent.glob(prefix + ".tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _jit(spec: OpSpec, digest: str) -> ModuleType:
    module_name = f"zero_kernels_{spec.name}_{digest}"
    final = cache_root() / f"{spec.name}-{digest}"
    so_path = final / (module_name + ".so")
    if (final / _COMPLETE).exists():
        return _import_file(module_name, so_path)

    timeout = float(os.environ.get("ZERO_KERNELS_LOCK_TIMEOUT", "600"))
    lock = final.parent / f"{final.name}.lock"

    def on_wait(holder: str) -> None:
        _log(f"waiting for {holder} to finish building op {spec.name!r} (lock {lock})")

    with FileLock(lock, timeout, on_wait=on_wait):
        if (final / _COMPLETE).exists():  # another process built it while we waited
            return _import_file(module_name, so_path)
        _check_toolchain(spec)
        _remove_dead_tmp_dirs(final.parent, final.name)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete folder from an old layout; never a finished one
        tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _log(f"building op {spec.name!r} just in time (first use) in {final} ...")
        start = time.perf_counter()
        module = _build(spec, digest, module_name, tmp)
        (tmp / _COMPLETE).write_text(digest)
        os.replace(tmp, final)
        _log(f"built op {spec.name!r} in {time.perf_counter() - start:.1f} s")
    # The module was imported from tmp; later processes import it from `final`.
    return module


def _build(spec: OpSpec, digest: str, module_name: str, build_dir: Path) -> ModuleType:
    from torch.utils import cpp_extension

    define = f"-DZERO_OP_SOURCE_HASH={digest}"
    try:
        return cpp_extension.load(
            name=module_name,
            sources=[str(spec.path(s)) for s in spec.sources],
            extra_cflags=[*spec.cflags, define],
            extra_cuda_cflags=[*spec.cuda_cflags, define],
            extra_ldflags=list(spec.ldflags),
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            with_cuda=spec.cuda,
            verbose=False,
        )
    except Exception as e:  # cpp_extension raises RuntimeError/OSError/CalledProcessError with the compiler output
        shutil.rmtree(build_dir, ignore_errors=True)
        raise BuildError(f"building op {spec.name!r} failed:\n{e}") from e


def load(name: str | OpSpec) -> ModuleType:
    """Return the extension module of op ``name`` (``"cpu_adam"``, ``"cuda_ops"``), building it on first use.

    Args:
        name: a registered op name (see ``zero_kernels.loader.OPS``) or an :class:`OpSpec`.

    Returns:
        The imported extension module.

    Raises:
        ValueError: unknown op name.
        BuildError: no compiler/ninja/CUDA, or the build failed (message holds the compiler output).
        LockTimeout: another live process held the build lock longer than ``$ZERO_KERNELS_LOCK_TIMEOUT`` s.
    """
    spec = _spec(name)
    digest = spec.source_hash()
    key = f"{spec.name}-{digest}"
    if key in _loaded:
        return _loaded[key]
    module = _prebuilt(spec, digest) or _jit(spec, digest)
    _loaded[key] = module
    return module


def available(name: str | OpSpec) -> bool:
    """True if :func:`load` succeeds for ``name`` (building it if needed); never raises for a build failure.

    The first failure is reported once on stderr and remembered for this process, so callers can fall back to torch.
    """
    spec = _spec(name)
    key = f"{spec.name}-{spec.source_hash()}"
    if key in _failed:
        return False
    try:
        load(spec)
        return True
    except BuildError as e:
        _failed[key] = e
        _log(f"op {spec.name!r} unavailable, falling back to torch: {str(e).splitlines()[0]}")
        return False


def resolved(name: str) -> ModuleType | None:
    """The module of registered op ``name``, or None when it cannot be built, decided once per process.

    For per-step callers (optimizer steps, quantization): :func:`load` and :func:`available` hash the op's sources
    on every call to notice edits, which costs more than a small step (0.4 ms a step of FusedAdam on an H200).
    """
    if name not in _resolved:
        _resolved[name] = load(name) if available(name) else None
    return _resolved[name]
