"""Every GPU check of the project in one command, with one report file (`nox -s gpu`, or directly on a machine
without nox: `python3 gpu/run.py`).

    python3 gpu/run.py [--report PATH] [--wheelhouse DIR] [--only NAME,...] [--budget SECONDS]
    python3 gpu/run.py --dry-run       # list the checks and the wheels it would install; runs nothing

The wheelhouse (default dist/gpu-wheelhouse, made by `nox -s gpu -- --prepare` on a machine with the internet:
our seven wheels plus what a bare CUDA machine lacks: pydantic, DeepSpeed 0.19.8 and their dependencies) is installed
with `pip --no-index --no-deps --target` into a temporary folder put first on the checks' PYTHONPATH (its `bin/`,
ninja's, first on PATH): the machine's own CUDA torch, transformers and numpy are used. Without a wheelhouse the
installed packages are used as they are. Just-in-time builds of DeepSpeed's ops go to one folder for the whole run
($TORCH_EXTENSIONS_DIR, default runs/torch-extensions: kept where the machine is kept between commands).

Each check runs in a process group of its own with a time limit, so a crash, a hang or a failed build of one is
recorded in the report and the others still run; at its limit the group is sent SIGTERM, then SIGKILL. A check's
limit is in $ZERO_GPU_CHECK_SECONDS, so a check that budgets its own work (peers, capacity) ends in time. The checks
run in the order listed, within --budget seconds in all (default 540, so the whole run, install included, fits a
10-minute command on one GPU); a check whose limit would cross the budget gets what is left, and one with under
20 s left is recorded as not run. A background check (the peers' op builds) starts in its turn and runs beside
the next checks until a timed one (whose figures are timings) is due, which first waits for it. The report
(Markdown, default runs/gpu-report-<time>.md) has a summary table and each check's output. Exit status: 0 when
every check passed or when this machine has no CUDA GPU (it says so in the report and on stdout), 1 when a check
failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / "dist" / "gpu-wheelhouse"
MIN_SECONDS = 20
BUDGET_S = 540.0  # all checks of a run, install included: a 600 s command keeps 60 s for the probe and margins
EXTENSIONS = ROOT / "runs" / "torch-extensions"  # DeepSpeed's JIT builds, shared by every check of a run


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: a script under gpu/ with its arguments, what it proves, and its time limit in seconds;
    ``background``: it runs beside the next checks; ``timed``: its figures are timings, so every background check
    has finished before it starts."""

    name: str
    what: str
    argv: tuple[str, ...]
    limit_s: int
    background: bool = False
    timed: bool = False


CHECKS = (
    Check("peer-ops", "the peers' just-in-time op builds (DeepSpeed's CPUAdam, FusedAdam, DeepCompile; zero-kernels' "
          "CPU Adam), timed apart from any step, in the background of the checks that time nothing",
          ("gpu/peer_ops.py",), 240, background=True),
    Check("cuda-ops", "build zero-kernels' CUDA ops (nvcc, JIT from the installed wheel's sources) and run "
          "packages/zero-kernels/tests/test_cuda_ops.py: FusedAdam and quantize equal their torch references",
          ("gpu/kernels.py", "tests"), 120),
    Check("parity", "engine at stages 0, 1, 2, 3, CPU optimizer offload, NVMe optimizer offload and compiled "
          "ZeRO-3 (aot_eager): 4 steps at world 1 over NCCL vs the same runs on the CPU (gloo); losses within rel 1e-3",
          ("gpu/parity.py", "--steps", "4"), 150),
    Check("peers", "zero vs DeepSpeed 0.19.8 vs FSDP2 at world 1, interleaved rounds, median step: stage 2, stage 3, "
          "ZeRO-Offload, SuperOffload, parameter offload, compiled ZeRO-3 on a 410M Llama, bf16; ratios and "
          "losses", ("gpu/peers.py",), 210, timed=True),
    Check("offload", "step time without offload, ZeRO-Offload, SuperOffload, stage-3 parameter offload; share of "
          "host<->device copy time overlapping kernels",
          ("gpu/offload.py", "--layers", "4", "--hidden", "1024", "--steps", "6"), 75, timed=True),
    Check("capacity", "largest Llama that trains a step at world 1 with optimizer offload, and with parameter "
          "offload too, zero vs DeepSpeed: parameters and tokens/s (a ladder searched within the time left)",
          ("gpu/capacity.py",), 150, timed=True),
    Check("compiled-zero3", "compiled ZeRO-3 (deepcompile, inductor) vs eager ZeRO-3 on the main job's Llama: "
          "first-step and median step time, losses within rel 1e-4",
          ("gpu/compiled_zero3.py", "--steps", "6"), 75, timed=True),
    Check("streams", "stage 3 under the torch profiler: all-gathers and reduce-scatters on streams of their own, "
          "overlapping compute kernels; losses equal plain PyTorch's within rel 1e-3",
          ("gpu/streams.py",), 45, timed=True),
    Check("kernel-bandwidth", "FusedAdam vs torch's fused AdamW and int8/int4 quantize/dequantize in GB/s, "
          "against the device copy bandwidth measured in the same run; subchannel FP8/INT8 Linear vs bf16 in ms",
          ("gpu/kernels.py", "bench"), 40, timed=True),
)  # fmt: skip


@dataclasses.dataclass
class Outcome:
    """What one check did: status is passed, FAILED, TIMED OUT or not run."""

    check: Check
    status: str
    seconds: float
    output: str


def wheels(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.whl")) if folder.is_dir() else []


def dry_run(folder: Path) -> int:
    print(f"gpu/run.py would run {len(CHECKS)} checks, each in its own process (limit in seconds; background: "
          "beside the next checks; timed: after every background check):")  # fmt: skip
    for c in CHECKS:
        kind = "background" if c.background else "timed" if c.timed else ""
        print(f"  {c.name:<17} {c.limit_s:>4} s {kind:<10} python3 {' '.join(c.argv)}\n      {c.what}")
    serial = sum(c.limit_s for c in CHECKS if not c.background)
    print(f"budget {BUDGET_S:.0f} s for all (--budget), install included; the limits of the checks that run one "
          f"after another add up to {serial} s: a check the budget no longer covers gets what is left, or is not "
          "run")  # fmt: skip
    found = wheels(folder)
    if not found:
        print(f"wheelhouse {folder}: none prepared (`nox -s build` then `nox -s gpu -- --prepare`); "
              "the installed packages would be used")  # fmt: skip
        return 0
    total = sum(w.stat().st_size for w in found)
    print(f"wheels it carries and installs (--no-index --no-deps --target), {total / 2**20:.1f} MiB from {folder}:")
    for w in found:
        print(f"  {w.name}  ({w.stat().st_size / 2**10:.0f} KiB)")
    return 0


def gpu_name() -> str | None:
    """The CUDA device's name, or None without torch or without a CUDA device (asked in a child process, so this
    process never initialises CUDA before the checks)."""
    probe = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None
    name = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    return name or None


def install(folder: Path) -> tuple[dict, str]:
    """Install the wheelhouse into a temporary folder; the environment the checks run with, and a note."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS))
    found = wheels(folder)
    if not found:
        return env, f"no wheelhouse at {folder}: the installed packages were used"
    site = tempfile.mkdtemp(prefix="zero-gpu-site-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site]
    subprocess.run([*cmd, *map(str, found)], check=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((os.path.join(site, "bin"), env.get("PATH", "")))  # ninja, for the JIT builds
    return env, f"installed {len(found)} wheels from {folder} into {site}: " + ", ".join(w.name for w in found)


@dataclasses.dataclass
class Running:
    """A started check: its process (leader of its own process group), its output file, start and limit."""

    check: Check
    proc: subprocess.Popen
    out: object  # the temporary file its stdout and stderr go to
    start: float
    limit_s: float


def start_check(check: Check, env: dict, limit_s: float) -> Running:
    """Start ``check`` in a new process group, its limit in $ZERO_GPU_CHECK_SECONDS."""
    out = tempfile.TemporaryFile("w+")
    env = dict(env, ZERO_GPU_CHECK_SECONDS=str(int(limit_s)))
    proc = subprocess.Popen([sys.executable, *check.argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    return Running(check, proc, out, time.perf_counter(), limit_s)


def _stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the process group (a check's own clean-up), up to ``grace_s`` for its leader to exit, then
    SIGKILL to whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def finish_check(run: Running) -> Outcome:
    """Wait for ``run`` until its limit; past it the check's whole process group is stopped."""
    left = run.limit_s - (time.perf_counter() - run.start)
    timed_out = False
    try:
        run.proc.wait(timeout=max(left, 0))
    except subprocess.TimeoutExpired:
        timed_out = True
    _stop_group(run.proc, grace_s=5.0 if timed_out else 0.0)  # what the check left running goes too
    run.out.seek(0)
    text = run.out.read()
    run.out.close()
    seconds = time.perf_counter() - run.start
    if timed_out:
        return Outcome(run.check, "TIMED OUT", seconds, text + f"\n(killed after {run.limit_s:.0f} s)")
    code = run.proc.returncode
    return Outcome(run.check, "passed" if code == 0 else f"FAILED (exit {code})", seconds, text)


def run_check(check: Check, env: dict, limit_s: float) -> Outcome:
    return finish_check(start_check(check, env, limit_s))


def report(outcomes: list[Outcome], header: list[str]) -> str:
    lines = ["# GPU checks", "", *header, "", "| check | status | seconds | what it checks |", "|---|---|---|---|"]
    lines += [f"| {o.check.name} | {o.status} | {o.seconds:.0f} | {o.check.what} |" for o in outcomes]
    for o in outcomes:
        tail = o.output[-12000:]
        lines += ["", f"## {o.check.name}: {o.status}", "", f"`python3 {' '.join(o.check.argv)}`", "", "```",
                  tail.rstrip(), "```"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Every GPU check of the project, one report file.")
    ap.add_argument("--dry-run", action="store_true", help="list the checks and the wheels; run nothing")
    ap.add_argument("--report", type=Path, help="report file (default runs/gpu-report-<time>.md)")
    ap.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE)
    ap.add_argument("--only", help="comma-separated check names")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all checks together")
    args = ap.parse_args(argv)
    checks = [c for c in CHECKS if not args.only or c.name in args.only.split(",")]
    unknown = set(args.only.split(",")) - {c.name for c in CHECKS} if args.only else set()
    if unknown:
        ap.error(f"unknown check(s) {sorted(unknown)}; known: {[c.name for c in CHECKS]}")
    if args.dry_run:
        return dry_run(args.wheelhouse)
    path = args.report or ROOT / "runs" / f"gpu-report-{time.strftime('%Y%m%d-%H%M%S')}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    name = gpu_name()
    if name is None:
        text = "no CUDA GPU on this machine (or no CUDA build of torch): no GPU check ran; nothing failed"
        path.write_text(f"# GPU checks\n\n{text}.\n")
        print(f"gpu/run.py: {text}. Report: {path}")
        return 0
    started = time.perf_counter()
    env, note = install(args.wheelhouse)
    header = [f"Device: {name}. Python {sys.version.split()[0]}.", "", note]
    outcomes: list[Outcome] = []
    run_all(checks, env, lambda: args.budget - (time.perf_counter() - started), outcomes,
            lambda: path.write_text(report(outcomes, header)))  # fmt: skip
    path.write_text(report(outcomes, header))
    print(f"gpu/run.py: report in {path}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


def run_all(checks: list[Check], env: dict, left, outcomes: list[Outcome], written=lambda: None) -> None:
    """Run ``checks`` in order within ``left()`` seconds (see the module docstring), appending to ``outcomes``;
    ``written()`` is called after each outcome (the report is rewritten, so a killed run keeps what it had)."""
    background: list[Running] = []

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        print(f"gpu/run.py: {outcome.check.name}: {outcome.status} in {outcome.seconds:.0f} s", flush=True)
        written()

    for check in checks:
        if check.timed:
            while background:  # timings only on a machine no build is loading
                record(finish_check(background.pop(0)))
        remaining = left()
        if remaining < MIN_SECONDS:
            outcomes.append(Outcome(check, "not run (budget spent)", 0.0, f"{remaining:.0f} s of the budget left"))
            continue
        limit = min(check.limit_s, remaining)
        print(f"gpu/run.py: {check.name} (limit {limit:.0f} s{', in the background' if check.background else ''})"
              " ...", flush=True)  # fmt: skip
        running = start_check(check, env, limit)
        if check.background:
            background.append(running)
        else:
            record(finish_check(running))
    while background:
        record(finish_check(background.pop(0)))


if __name__ == "__main__":
    sys.exit(main())
