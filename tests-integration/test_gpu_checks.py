"""The GPU checks (gpu/) where no GPU is visible (CUDA_VISIBLE_DEVICES empty, so these hold on a GPU machine
too): each script says "no CUDA" and exits 0; `gpu/run.py --dry-run`
lists every check and the wheels it would install; without a GPU it writes a report saying so and exits 0; a
background check runs beside the next checks and is finished before a timed one, a timed-out check's processes all
go; the analyses the checks rest on are right on hand-made inputs (trace streams, copy overlap, loss comparison,
the peers' medians, ratios and round orders, the capacity ladder's search on a made-up memory limit); the config
each peer is given; and the machinery of the parity check (CPU against CPU: equal losses), of the peers check
(zero and FSDP2 on the CPU, interleaved) and of a capacity trial runs for real on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
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
     ("parity", []), ("peers", []), ("capacity", []), ("peer_ops", [])],
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
    names = (
        "zero_comm-0.2.0-py3-none-any.whl",
        "pydantic-2.14.4-py3-none-any.whl",
        "deepspeed-0.19.8-py3-none-any.whl",
        "hjson-3.1.0-py3-none-any.whl",
        "ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    )
    for name in names:
        with zipfile.ZipFile(house / name, "w") as z:
            z.writestr("x.txt", "x" * 4096)
    out = subprocess.run([sys.executable, str(GPU / "run.py"), "--dry-run", "--wheelhouse", str(house)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    for check in run.CHECKS:
        assert check.name in out and " ".join(check.argv) in out
    assert [c.name for c in run.CHECKS] == ["peer-ops", "cuda-ops", "parity", "peers", "offload", "capacity",
                                            "compiled-zero3", "streams", "kernel-bandwidth"]  # fmt: skip
    assert all(name in out for name in names)
    kinds = {c.name: "background" if c.background else "timed" if c.timed else "" for c in run.CHECKS}
    assert kinds["peer-ops"] == "background" and kinds["cuda-ops"] == kinds["parity"] == ""
    assert all(f"{c.name:<17} {c.limit_s:>4} s {kinds[c.name]:<10}" in out for c in run.CHECKS)
    assert f"budget {run.BUDGET_S:.0f} s for all" in out
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


def test_the_checks_fit_one_ten_minute_command():
    """The default budget leaves time for the GPU probe and Python's start in a 600 s command; the background
    op builds fit beside the untimed checks after them."""
    run = _load("run")
    assert run.BUDGET_S + 45 <= 600
    bg = next(c for c in run.CHECKS if c.background)
    untimed = [c for c in run.CHECKS[run.CHECKS.index(bg) + 1 :] if not c.timed and not c.background]
    assert untimed and bg.limit_s <= sum(c.limit_s for c in untimed) + 30


def test_background_checks_run_beside_the_next_and_finish_before_a_timed_one(tmp_path):
    run = _load("run")
    flag = tmp_path / "built"
    (tmp_path / "bg.py").write_text(f"import time, pathlib; time.sleep(2); pathlib.Path({str(flag)!r}).touch()\n")
    probe = f"import os, pathlib; print(pathlib.Path({str(flag)!r}).exists(), os.environ['ZERO_GPU_CHECK_SECONDS'])\n"
    (tmp_path / "probe.py").write_text(probe)
    checks = [run.Check("bg", "bg", (str(tmp_path / "bg.py"),), 30, background=True),
              run.Check("untimed", "u", (str(tmp_path / "probe.py"),), 30),
              run.Check("timed", "t", (str(tmp_path / "probe.py"),), 25, timed=True)]  # fmt: skip
    outcomes = []
    run.run_all(checks, {"PATH": "/usr/bin:/bin"}, lambda: 500.0, outcomes)
    got = {o.check.name: (o.status, o.output.strip()) for o in outcomes}
    assert got == {"untimed": ("passed", "False 30"), "bg": ("passed", ""), "timed": ("passed", "True 25")}
    assert [o.check.name for o in outcomes] == ["untimed", "bg", "timed"]


def test_a_timed_out_check_takes_its_children_along(tmp_path):
    run = _load("run")
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, time, pathlib\np = subprocess.Popen(['sleep', '60'])\n"
              f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n"
              "print('started', flush=True)\ntime.sleep(60)\n")  # fmt: skip
    (tmp_path / "hang.py").write_text(script)
    outcome = run.run_check(run.Check("hang", "h", (str(tmp_path / "hang.py"),), 5), {"PATH": "/usr/bin:/bin"}, 3)
    assert outcome.status == "TIMED OUT" and "started" in outcome.output
    child = int(pid_file.read_text())
    for _ in range(50):  # reaped by init once killed
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the check's child {child} outlived it")


def test_peer_configs_give_zero_and_deepspeed_one_config():
    """Every configuration's dict: clipping and AdamW's hyper-parameters set explicitly (DeepSpeed would clip at
    1.0 by default), bf16, the stage and offload sections each names; zero's config loader accepts it as it is;
    FSDP2's optimizer gets the same hyper-parameters."""
    sys.path.insert(0, str(GPU))
    pc = _load("peer_configs")
    from zero.config import load_config

    assert pc.SETUP_NAMES == ("stage2", "stage3", "zero-offload", "superoffload", "param-offload", "compiled-z3")
    hyper = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    for setup in pc.SETUPS:
        cfg = pc.engine_config(setup, micro=4)
        assert cfg["gradient_clipping"] == pc.CLIP == 1.0
        assert cfg["optimizer"] == {"type": "AdamW", "params": hyper}
        assert cfg["bf16"] == {"enabled": True} and cfg["train_batch_size"] == 4
        zo = cfg["zero_optimization"]
        assert zo["stage"] == setup.stage and zo["overlap_comm"] is True
        assert ("offload_optimizer" in zo) == (setup.offload_optimizer != "none")
        assert zo.get("offload_optimizer", {}).get("super_offload", False) == (setup.name == "superoffload")
        assert ("offload_param" in zo) == (setup.name == "param-offload")
        assert cfg.get("compile") == ({"deepcompile": True} if setup.name == "compiled-z3" else None)
        engine = load_config(pc.engine_config(setup, micro=4, pin_memory=False))
        assert engine.gradient_clipping == 1.0 and engine.zero_optimization.stage == setup.stage
    assert pc.engine_config(pc.setup_named("param-offload"), 4, pin_memory=False)["zero_optimization"][
        "offload_param"] == {"device": "cpu", "pin_memory": False}  # fmt: skip
    assert [s.name for s in pc.SETUPS if pc.runs(s, "fsdp2")] == ["stage2", "stage3", "param-offload", "compiled-z3"]
    assert pc.fsdp2_plan(pc.setup_named("stage2")) == {"reshard_after_forward": False, "cpu_offload": False,
                                                       "compile": False}  # fmt: skip
    assert pc.fsdp2_plan(pc.setup_named("param-offload"))["cpu_offload"] is True
    with pytest.raises(ValueError, match="no SuperOffload"):
        pc.fsdp2_plan(pc.setup_named("superoffload"))
    pw = _load("peer_workers")
    import torch

    defaults = pw.fsdp2_optimizer([torch.nn.Parameter(torch.zeros(2))]).defaults
    assert {k: defaults[k] for k in hyper} == hyper | {"betas": (0.9, 0.95)} and defaults["fused"] is True


def test_shape_params_count_the_built_model():
    sys.path.insert(0, str(GPU))
    pc = _load("peer_configs")
    pw = _load("peer_workers")
    for shape in (pc.CPU_SHAPE, pc.Shape.llama(128, 2)):
        model = pw.build_model(shape, 32, "cpu")
        assert sum(p.numel() for p in model.parameters()) == shape.params()
        assert all(torch_equal_bf16(p) for p in model.parameters())  # rounded to bf16 values
    assert pc.Shape.llama(4096, 32) == pc.Shape(4096, 32, 32, 11008)  # Llama-2 7B's proportions
    assert round(pc.PEER_SHAPE.params() / 1e6) == 412


def torch_equal_bf16(p) -> bool:
    import torch

    return bool(torch.equal(p.detach(), p.detach().to(torch.bfloat16).float()))


def test_peers_bookkeeping():
    sys.path.insert(0, str(GPU))
    peers = _load("peers")
    pc = _load("peer_configs")
    assert peers.round_orders(["z", "d", "f"], 4) == [["z", "d", "f"], ["d", "f", "z"], ["f", "z", "d"],
                                                      ["z", "d", "f"]]  # fmt: skip
    assert peers.ratio(2.0, 4.0) == 0.5 and peers.ratio(None, 4.0) is None and peers.ratio(1.0, 0.0) is None
    assert peers.max_rel_diff([1.0, 2.02], [1.0, 2.0]) == pytest.approx(0.01) and peers.max_rel_diff([], [1.0]) is None
    cells = {"zero": peers.Cell(times=[0.1, 0.3, 0.2], losses=[5.0, 4.0]),
             "deepspeed": peers.Cell(times=[0.4, 0.4, 0.5], losses=[5.0, 4.04]),
             "fsdp2": peers.Cell(error="RuntimeError: boom")}  # fmt: skip
    r = peers.row(pc.setup_named("stage3"), cells, list(pc.PEERS))
    assert r["median_s"] == {"zero": 0.2, "deepspeed": 0.4, "fsdp2": None}
    assert r["zero/deepspeed"] == pytest.approx(0.5) and r["zero/fsdp2"] is None
    assert r["loss_rel_diff"] == {"deepspeed": pytest.approx(0.01), "fsdp2": None}
    assert r["errors"] == {"fsdp2": "RuntimeError: boom"} and not peers.passed(r)
    lines = peers.table([r], list(pc.PEERS))
    assert lines[2] == "| stage3 | 200.0 | 400.0 | error | 0.50x | - | deepspeed 1.0e-02 |"
    offload = peers.row(pc.setup_named("zero-offload"), {k: cells[k] for k in ("zero", "deepspeed")}, list(pc.PEERS))
    assert peers.passed(offload) and "fsdp2" in offload["absent"]
    assert peers.table([offload], list(pc.PEERS))[2].startswith("| zero-offload | 200.0 | 400.0 | n/a | 0.50x | - |")
    far = peers.row(pc.setup_named("stage2"), {"zero": cells["zero"], "deepspeed": peers.Cell([0.1], [5.0, 5.0])},
                    ["zero", "deepspeed"])  # fmt: skip
    assert not peers.passed(far)  # 25% apart: a different training, not rounding


def test_capacity_ladder_and_search_on_a_made_up_memory_limit():
    sys.path.insert(0, str(GPU))
    cap = _load("capacity")
    params = [s.params() for s in cap.LADDER]
    assert params == sorted(params) and 0.7e9 < params[0] < 1e9 and params[-1] > 60e9
    gib = 2**30
    # 115 GiB of the host available, 80 GiB GPU: the host binds (16 and 18 bytes a parameter, 85% of it)
    start = {m: cap.LADDER[cap.predict_start(cap.LADDER, m, 115 * gib, 80 * gib)] for m in ("optimizer", "param")}
    assert (start["optimizer"].hidden, start["optimizer"].layers, start["param"].hidden, start["param"].layers) == (
        4096, 32, 4096, 24)  # fmt: skip
    assert cap.predict_start(cap.LADDER, "optimizer", 10**12, 8 * gib) == 1  # an 8 GiB GPU binds (4 bytes)
    assert cap.predict_start(cap.LADDER, "param", 10**6, None) == 0

    def search(limit: int, start: int) -> tuple[int | None, list[int]]:
        s, tried = cap.LadderSearch(len(params), start), []
        while (i := s.next()) is not None:
            tried.append(i)
            s.record(i, params[i] <= limit)
        return s.largest, tried

    assert search(params[6], 5) == (6, [5, 6, 7])  # fits, one up fits, the next does not
    assert search(params[2], 5) == (2, [5, 4, 2, 3])  # fails, steps down 1 then 2, then bisects
    assert search(params[0] - 1, 3) == (None, [3, 2, 0])  # nothing fits
    assert search(params[-1], 10) == (11, [10, 11])  # the top of the ladder

    clock = [0.0]

    def trial(key, rung, timeout):
        mode, peer = key
        clock[0] += 20.0 * params[rung] / params[0]  # a trial's seconds grow with the model
        if peer == "broken":
            return cap.Trial(key, rung, params[rung], "error", 1.0, "ValueError: bad config")
        fits = params[rung] <= (params[4] if mode == "optimizer" else params[3])
        return cap.Trial(key, rung, params[rung], "fits" if fits else "does not fit", 20.0 * params[rung] / params[0],
                         tokens_per_s=1000.0 if peer == "zero" else 800.0, step_s=[1.0, 2.0 if peer == "zero" else 2.5],
                         init_s=3.0)  # fmt: skip

    keys = [("optimizer", "zero"), ("optimizer", "deepspeed"), ("param", "zero"), ("param", "broken")]
    searches, trials = cap.searches_for(keys, {"optimizer": 4, "param": 3}, len(cap.LADDER)), []
    cap.run_searches(searches, cap.LADDER, trial, lambda: 10_000 - clock[0], 60.0, trials)
    assert {k: s.largest for k, s in searches.items()} == {keys[0]: 4, keys[1]: 4, keys[2]: 3, keys[3]: None}
    assert [(t.key[1], t.rung) for t in trials[:4]] == [("zero", 4), ("deepspeed", 4), ("zero", 3), ("broken", 3)]
    assert "error at rung 3" in searches[keys[3]].stopped
    text = "\n".join(cap.summary(searches, trials, cap.LADDER))
    assert "| optimizer | zero | 3.63B | 3072 x 32 | 1000 |" in text and "does not fit" in text
    assert "optimizer offload, both at 3.63B: zero 1000 tokens/s, DeepSpeed 800 tokens/s: zero/DeepSpeed step " \
           "time 0.80x" in text  # fmt: skip
    # the time left covers the first trials only: the rest are not started
    clock[0] = 0.0
    searches, trials = cap.searches_for(keys[:2], {"optimizer": 4}, len(cap.LADDER)), []
    cap.run_searches(searches, cap.LADDER, trial, lambda: 200 - clock[0], 60.0, trials)
    assert len(trials) == 2 and all("time left" in s.stopped for s in searches.values())


def test_peers_and_a_capacity_trial_run_on_the_cpu():
    """The machinery for real on the CPU: zero and FSDP2 in their worker processes, interleaved (stage 3, tiny
    Llama, the same losses), and one capacity trial of zero with optimizer offload (the smallest CPU rung)."""
    env = dict(NO_GPU, PYTHONPATH=os.pathsep.join([str(GPU), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(GPU / "peers.py"), "--device", "cpu", "--setups", "stage3", "--peers",
                          "zero,fsdp2", "--rounds", "2", "--steps", "1", "--warmup", "1"], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    row = [line for line in out.stdout.splitlines() if line.startswith("| stage3 |")][-1]  # the final table's
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "-" and cells[4].endswith("x") and cells[5] == "fsdp2 0.0e+00", out.stdout  # same losses
    sys.path.insert(0, str(GPU))
    cap = _load("capacity")
    t = cap.spawn_trial(("optimizer", "zero"), 0, 240, "cpu", "cpu", cap.CPU_LADDER[0].params())
    assert t.status == "fits", t.why
    assert t.tokens_per_s > 0 and len(t.step_s) == 2 and t.peak_host_bytes > 0 and t.why.startswith("loss ")


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
