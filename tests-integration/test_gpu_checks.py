"""The GPU checks (gpu/) where no GPU is visible (CUDA_VISIBLE_DEVICES empty, so these hold on a GPU machine
too): each script says "no CUDA" and exits 0; `gpu/run.py --dry-run`
lists every check and the wheels it would install; without a GPU it writes a report saying so and exits 0; the
analyses the checks rest on are right on hand-made inputs (trace streams, copy overlap, loss comparison); and the
parity check's two-process machinery runs for real on the CPU (CPU against CPU: equal losses)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "gpu"
NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module while the file runs
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "script,args",
    [("kernels", ["tests"]), ("kernels", ["bench"]), ("streams", []), ("offload", []), ("compiled_zero3", []),
     ("parity", [])],
)  # fmt: skip
def test_each_check_without_cuda_says_so(script, args):
    proc = subprocess.run([sys.executable, str(GPU / f"{script}.py"), *args], env=NO_GPU, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA" in proc.stdout


def test_dry_run_lists_every_check_and_the_wheels(tmp_path):
    run = _load("run")
    house = tmp_path / "house"
    house.mkdir()
    for name in ("zero_comm-0.2.0-py3-none-any.whl", "pydantic-2.14.4-py3-none-any.whl"):
        with zipfile.ZipFile(house / name, "w") as z:
            z.writestr("x.txt", "x" * 4096)
    out = subprocess.run([sys.executable, str(GPU / "run.py"), "--dry-run", "--wheelhouse", str(house)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    for check in run.CHECKS:
        assert check.name in out and " ".join(check.argv) in out
    assert {c.name for c in run.CHECKS} == {"cuda-ops", "parity", "streams", "kernel-bandwidth", "offload",
                                             "compiled-zero3"}  # fmt: skip
    assert "zero_comm-0.2.0-py3-none-any.whl" in out and "pydantic-2.14.4-py3-none-any.whl" in out
    empty = subprocess.run([sys.executable, str(GPU / "run.py"), "--dry-run", "--wheelhouse", str(tmp_path / "none")],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "none prepared" in empty


def test_without_a_gpu_the_run_reports_so_and_exits_0(tmp_path):
    report = tmp_path / "r.md"
    proc = subprocess.run([sys.executable, str(GPU / "run.py"), "--report", str(report)], env=NO_GPU,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU" in proc.stdout and "no GPU check ran" in report.read_text()


def test_a_failing_or_hanging_check_is_recorded_and_the_next_still_runs(tmp_path):
    run = _load("run")
    (tmp_path / "bad.py").write_text("import sys; print('boom'); sys.exit(3)\n")
    (tmp_path / "slow.py").write_text("import time; time.sleep(30)\n")
    (tmp_path / "good.py").write_text("print('fine')\n")
    env = {"PATH": "/usr/bin:/bin"}
    outcomes = [run.run_check(run.Check(n, n, (str(tmp_path / f"{n}.py"),), 5), env, limit)
                for n, limit in (("bad", 5), ("slow", 1), ("good", 5))]  # fmt: skip
    assert [o.status for o in outcomes] == ["FAILED (exit 3)", "TIMED OUT", "passed"]
    text = run.report(outcomes, ["Device: none."])
    assert "| bad | FAILED (exit 3) |" in text and "boom" in text and "| good | passed |" in text


def _event(name, stream, ts, dur, cat="kernel", corr=None):
    args = {"stream": stream} if corr is None else {"stream": stream, "correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_streams_trace_analysis(tmp_path):
    streams = _load("streams")
    trace = tmp_path / "t.json"
    # several ranks: NCCL kernels named by their collective
    events = [_event("ampere_sgemm", 7, 0, 100), _event("ampere_sgemm", 7, 150, 100),
              _event("ncclDevKernel_AllGather_RING_LL", 20, 50, 100),  # half over the first gemm, half idle
              _event("ncclDevKernel_ReduceScatter", 21, 240, 20), {"ph": "i", "name": "marker"}]  # fmt: skip
    trace.write_text(json.dumps({"traceEvents": events}))
    got = streams._streams(str(trace))
    assert got == {"compute_streams": [7], "gather_streams": [20], "gather_us": 100, "gather_overlap_us": 50,
                   "reduce_streams": [21], "reduce_us": 20, "reduce_overlap_us": 10}  # fmt: skip
    # one rank: NCCL copies; each copy is told apart by the zero:: range its launch ran in (same thread)
    events = [_event("ampere_sgemm", 7, 0, 100),
              {"ph": "X", "cat": "user_annotation", "name": "zero::gather", "ts": 0, "dur": 10, "tid": 1},
              _event("cudaMemcpyAsync", None, 2, 1, cat="cuda_runtime", corr=11) | {"tid": 1},
              _event("Memcpy DtoD", 20, 90, 20, cat="gpu_memcpy", corr=11),
              {"ph": "X", "cat": "user_annotation", "name": "zero::reduce", "ts": 50, "dur": 10, "tid": 2},
              _event("cudaMemcpyAsync", None, 55, 1, cat="cuda_runtime", corr=12) | {"tid": 2},
              _event("Memcpy DtoD", 21, 95, 10, cat="gpu_memcpy", corr=12)]  # fmt: skip
    trace.write_text(json.dumps({"traceEvents": events}))
    got = streams._streams(str(trace))
    assert (got["gather_streams"], got["gather_us"], got["gather_overlap_us"]) == ([20], 20, 10)
    assert (got["reduce_streams"], got["reduce_us"], got["reduce_overlap_us"]) == ([21], 10, 5)


def test_offload_overlap_fraction():
    f = _load("offload").overlap_fraction
    assert f([], [(0, 1)]) is None
    assert f([(0, 2)], [(1, 3)]) == 0.5
    assert f([(0, 2), (4, 6)], [(0, 1), (0.5, 2), (10, 11)]) == 0.5  # overlapping kernels counted once
    assert f([(0, 1)], []) == 0.0


def test_parity_comparison():
    parity = _load("parity")
    ref = {"a": {"losses": [1.0, 2.0]}, "b": {"losses": [1.0]}, "c": {"losses": [1.0]}}
    got = {"a": {"losses": [1.0005, 2.0]}, "b": {"losses": [1.01]}, "c": {"error": "Traceback\nValueError: bad"}}
    rows = {case: (ok, seen) for case, ok, seen in parity.compare(got, ref)}
    assert rows["a"][0] and not rows["b"][0] and not rows["c"][0]
    assert "max rel 5.0e-04" in rows["a"][1] and "max rel 1.0e-02" in rows["b"][1]
    assert rows["c"][1] == "error: ValueError: bad"


def test_parity_runs_both_sides_in_their_own_processes():
    """The machinery for real, CPU against CPU (one stage-3 case, 2 steps): the same losses on both sides."""
    out = subprocess.run([sys.executable, str(GPU / "parity.py"), "--device", "cpu", "--cases", "stage3",
                          "--steps", "2"], env=NO_GPU, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| stage3 |"))
    assert "| yes |" in row and "max rel 0.0e+00" in row
