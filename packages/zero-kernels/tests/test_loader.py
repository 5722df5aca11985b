"""The op loader: JIT build into a hashed cache, rebuild on source change, clear errors, one build under concurrency,
no hang after a builder is SIGKILLed, a bounded wait on a live holder, and prebuilt modules when hashes match.

A tiny op that includes only Python.h keeps each build to about a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import zero_kernels as zk
from zero_kernels import loader

TINY = textwrap.dedent(
    """
    #include <Python.h>
    #define S_(x) #x
    #define S(x) S_(x)
    #define CAT_(a, b) a##b
    #define CAT(a, b) CAT_(a, b)
    static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, S(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
    PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
      PyObject* m = PyModule_Create(&def);
      PyModule_AddStringConstant(m, "source_hash", S(ZERO_OP_SOURCE_HASH));
      PyModule_AddIntConstant(m, "answer", ANSWER);
      return m;
    }
    """
)


def _tiny(tmp_path: Path, answer: int = 42, name: str = "tiny") -> zk.OpSpec:
    src = tmp_path / "src" / "tiny.cpp"
    src.parent.mkdir(exist_ok=True)
    src.write_text(TINY.replace("ANSWER", str(answer)))
    return zk.OpSpec(name=name, sources=(str(src),), cflags=("-O0",), prebuilt_module=f"no_such_prebuilt_{name}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ZERO_KERNELS_LOCK_TIMEOUT", raising=False)
    loader._loaded.clear()
    loader._failed.clear()
    yield tmp_path / "cache"
    loader._loaded.clear()
    loader._failed.clear()


def _script(src: Path, answer: int) -> str:
    return (
        "import zero_kernels as zk\n"
        f"spec = zk.OpSpec(name='tiny', sources=({str(src)!r},), cflags=('-O0',), prebuilt_module='no_such')\n"
        f"assert zk.load(spec).answer == {answer}\n"
        "print('LOADED', flush=True)\n"
    )


def _spawn(code: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


@pytest.mark.smoke
def test_builds_once_reports_time_and_reuses_cache(tmp_path, cache, capfd):
    spec = _tiny(tmp_path)
    assert zk.load(spec).answer == 42
    err = capfd.readouterr().err
    assert err.count("building op 'tiny' just in time") == 1 and "built op 'tiny' in" in err
    assert zk.load(spec) is zk.load(spec)  # memoised in-process
    built = cache.glob(f"*/tiny-{spec.source_hash()}/.complete")
    assert len(list(built)) == 1
    # A fresh process imports the cached build without building or printing.
    proc = subprocess.run([sys.executable, "-c", _script(tmp_path / "src" / "tiny.cpp", 42)], env=dict(os.environ),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "building" not in proc.stderr


def test_source_change_rebuilds(tmp_path, cache):
    first = _tiny(tmp_path, answer=1)
    first_hash = first.source_hash()
    assert zk.load(first).answer == 1
    second = _tiny(tmp_path, answer=2)  # the same file, edited
    assert second.source_hash() != first_hash
    assert zk.load(second).answer == 2
    assert len(list(cache.glob("*/tiny-*/.complete"))) == 2


def test_failed_build_carries_compiler_message(tmp_path, cache):
    src = tmp_path / "broken.cpp"
    src.write_text("int main() { return undeclared_identifier_xyz; }\n")
    spec = zk.OpSpec(name="broken", sources=(str(src),), prebuilt_module="no_such")
    with pytest.raises(zk.BuildError, match=r"(?s)building op 'broken' failed.*undeclared_identifier_xyz"):
        zk.load(spec)
    assert zk.available(spec) is False
    assert not list(cache.glob("*/broken-*/.complete"))


def test_missing_compiler_is_named(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(zk.BuildError, match=r"C\+\+ compiler '.*no-such-c\+\+' not found"):
        zk.load(_tiny(tmp_path))


def test_unknown_op_name():
    with pytest.raises(ValueError, match=r"unknown op 'nope'; known ops: \['aio', 'cpu_adam', 'cuda_ops'\]"):
        zk.load("nope")


def test_concurrent_first_uses_build_once(tmp_path, cache):
    spec = _tiny(tmp_path, answer=7)
    env = dict(os.environ)
    procs = [_spawn(_script(tmp_path / "src" / "tiny.cpp", 7), env) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "LOADED" in out, err
    assert sum(err.count("building op 'tiny' just in time") for _, err in outs) == 1
    assert len(list(cache.glob(f"*/tiny-{spec.source_hash()}/.complete"))) == 1


def test_sigkilled_builder_does_not_block_the_next_load(tmp_path, cache):
    """A builder killed mid-build (its compiler still sleeping) leaves its lock file; the next load proceeds."""
    spec = _tiny(tmp_path, answer=9)
    slow = tmp_path / "slow-c++"
    # Only compiles are slow (torch also runs the compiler to read its version before writing build.ninja).
    slow.write_text('#!/bin/sh\ncase " $* " in *" -c "*) sleep 60;; esac\nexec c++ "$@"\n')
    slow.chmod(0o755)
    builder = _spawn(_script(tmp_path / "src" / "tiny.cpp", 9), {**os.environ, "CXX": str(slow)},
                     start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # wait until it holds the lock and its compiler is running
            locks = list(cache.glob(f"*/tiny-{spec.source_hash()}.lock"))
            tmps = list(cache.glob(f"*/tiny-{spec.source_hash()}.tmp-*/build.ninja"))
            if locks and tmps and locks[0].read_text().strip() == str(builder.pid):
                lock = locks[0]
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"builder never started building: {builder.stderr.read() if builder.poll() else ''}")
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait(timeout=10)
        assert lock.exists() and lock.read_text().strip() == str(builder.pid)  # the lock file is left behind
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _script(tmp_path / "src" / "tiny.cpp", 9)],
                              env=dict(os.environ), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.returncode == 0 and "LOADED" in proc.stdout, proc.stderr
        assert time.monotonic() - start < 60  # never waited for the dead builder's sleeping compiler
        assert not list(cache.glob(f"*/tiny-{spec.source_hash()}.tmp-{builder.pid}"))  # its folder was cleaned
    finally:
        try:
            os.killpg(builder.pid, signal.SIGKILL)  # the orphaned ninja/sleep of the killed builder
        except ProcessLookupError:
            pass


def test_live_holder_fails_within_bound_naming_lock(tmp_path, cache, monkeypatch):
    spec = _tiny(tmp_path)
    lock = loader.cache_root() / f"tiny-{spec.source_hash()}.lock"
    holder = _spawn(
        "import sys, time\nfrom pathlib import Path\nfrom zero_kernels._filelock import FileLock\n"
        f"with FileLock(Path({str(lock)!r}), 5):\n    print('HELD', flush=True)\n    time.sleep(60)\n",
        dict(os.environ),
    )
    try:
        assert holder.stdout.readline().strip() == "HELD"
        monkeypatch.setenv("ZERO_KERNELS_LOCK_TIMEOUT", "1")
        start = time.monotonic()
        with pytest.raises(zk.LockTimeout, match=rf"{lock}.*held by pid {holder.pid}") as info:
            zk.load(spec)
        assert time.monotonic() - start < 10 and info.value.path == lock
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_prebuilt_module_used_only_when_hash_matches(tmp_path, cache, monkeypatch, capfd):
    spec = _tiny(tmp_path, answer=5)
    pkg = tmp_path / "pre"
    pkg.mkdir()
    (pkg / "tiny_prebuilt_ok.py").write_text(f"source_hash = {spec.source_hash()!r}\nanswer = 'prebuilt'\n")
    (pkg / "tiny_prebuilt_old.py").write_text("source_hash = '0000000000000000'\nanswer = 'stale'\n")
    monkeypatch.syspath_prepend(str(pkg))
    ok = zk.OpSpec(**{**spec.__dict__, "prebuilt_module": "tiny_prebuilt_ok"})
    assert zk.load(ok).answer == "prebuilt"
    assert not cache.exists()  # nothing was built
    loader._loaded.clear()  # a new process, as far as the loader knows
    old = zk.OpSpec(**{**spec.__dict__, "prebuilt_module": "tiny_prebuilt_old"})
    assert zk.load(old).answer == 5  # stale prebuilt ignored, JIT build instead
    assert "hash mismatch" in capfd.readouterr().err


def test_cpu_adam_op_reports_its_source_hash():
    op = zk.load("cpu_adam")
    assert op.source_hash == loader.OPS["cpu_adam"].source_hash()
    assert op.supported_isas()[-1] == "generic"
