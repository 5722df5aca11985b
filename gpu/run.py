"""Every GPU check of the project in one command, with one report file (`nox -s gpu`, or directly on a machine
without nox: `python3 gpu/run.py`).

    python3 gpu/run.py [--report PATH] [--wheelhouse DIR] [--only NAME,...] [--budget SECONDS]
    python3 gpu/run.py --dry-run       # list the checks and the wheels it would install; runs nothing

The wheelhouse (default dist/gpu-wheelhouse, made by `nox -s gpu -- --prepare` on a machine with the internet:
our seven wheels plus what a bare CUDA machine lacks, pydantic and its dependencies) is installed with
`pip --no-index --no-deps --target` into a temporary folder put first on the checks' PYTHONPATH: the machine's own
CUDA torch, transformers and numpy are used. Without a wheelhouse the installed packages are used as they are.

Each check runs in a process of its own with a time limit, so a crash, a hang or a failed build of one is recorded
in the report and the others still run. The checks run in the order listed, within --budget seconds in all
(default 450, so the whole run, install included, stays under 8 minutes on one GPU); a check whose limit would
cross the budget gets what is left, and one with under 20 s left is recorded as not run. The report (Markdown,
default runs/gpu-report-<time>.md) has a summary table and each check's output. Exit status: 0 when every check
passed or when this machine has no CUDA GPU (it says so in the report and on stdout), 1 when a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = ROOT / "dist" / "gpu-wheelhouse"
MIN_SECONDS = 20


@dataclasses.dataclass(frozen=True)
class Check:
    """One check: a script under gpu/ with its arguments, what it proves, and its time limit in seconds."""

    name: str
    what: str
    argv: tuple[str, ...]
    limit_s: int


CHECKS = (
    Check("cuda-ops", "build zero-kernels' CUDA ops (nvcc, JIT from the installed wheel's sources) and run "
          "packages/zero-kernels/tests/test_cuda_ops.py: FusedAdam and quantize equal their torch references",
          ("gpu/kernels.py", "tests"), 240),
    Check("parity", "engine at stages 0, 1, 2, 3, CPU optimizer offload, NVMe optimizer offload and compiled "
          "ZeRO-3 (aot_eager): 4 steps at world 1 over NCCL vs the same runs on the CPU (gloo); losses within rel 1e-3",
          ("gpu/parity.py", "--steps", "4"), 180),
    Check("streams", "stage 3 under the torch profiler: all-gathers and reduce-scatters on streams of their own, "
          "overlapping compute kernels; losses equal plain PyTorch's within rel 1e-3",
          ("gpu/streams.py",), 90),
    Check("kernel-bandwidth", "FusedAdam vs torch's fused AdamW and int8/int4 quantize/dequantize in GB/s, "
          "against the device copy bandwidth measured in the same run",
          ("gpu/kernels.py", "bench"), 60),
    Check("offload", "step time without offload, ZeRO-Offload, SuperOffload, stage-3 parameter offload; share of "
          "host<->device copy time overlapping kernels",
          ("gpu/offload.py", "--layers", "4", "--hidden", "1024", "--steps", "6"), 120),
    Check("compiled-zero3", "compiled ZeRO-3 (deepcompile, inductor) vs eager ZeRO-3 on the main job's Llama: "
          "first-step and median step time, losses within rel 1e-4",
          ("gpu/compiled_zero3.py", "--steps", "6"), 150),
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
    print(f"gpu/run.py would run {len(CHECKS)} checks, each in its own process (limit in seconds):")
    for c in CHECKS:
        print(f"  {c.name:<17} {c.limit_s:>4} s  python3 {' '.join(c.argv)}\n      {c.what}")
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
    found = wheels(folder)
    if not found:
        return env, f"no wheelhouse at {folder}: the installed packages were used"
    site = tempfile.mkdtemp(prefix="zero-gpu-site-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", site]
    subprocess.run([*cmd, *map(str, found)], check=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    return env, f"installed {len(found)} wheels from {folder} into {site}: " + ", ".join(w.name for w in found)


def run_check(check: Check, env: dict, limit_s: float) -> Outcome:
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *check.argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=limit_s)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Outcome(check, "TIMED OUT", time.perf_counter() - start, text + f"\n(killed after {limit_s:.0f} s)")
    status = "passed" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
    return Outcome(check, status, time.perf_counter() - start, proc.stdout + proc.stderr)


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
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all checks together")
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
    outcomes = []
    for check in checks:
        left = args.budget - (time.perf_counter() - started)
        if left < MIN_SECONDS:
            outcomes.append(Outcome(check, "not run (budget spent)", 0.0, f"{left:.0f} s of the budget left"))
            continue
        print(f"gpu/run.py: {check.name} (limit {min(check.limit_s, left):.0f} s) ...", flush=True)
        outcomes.append(run_check(check, env, min(check.limit_s, left)))
        print(f"gpu/run.py: {check.name}: {outcomes[-1].status} in {outcomes[-1].seconds:.0f} s", flush=True)
        path.write_text(report(outcomes, header))  # written after each check: a killed run keeps what it had
    path.write_text(report(outcomes, header))
    print(f"gpu/run.py: report in {path}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
