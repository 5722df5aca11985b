"""The largest model that trains under a per-rank memory budget: pipeline parallelism (pp=2, zero's 1F1B, one stage
per rank) against data parallelism (dp=2, ZeRO-1) on 2 gloo ranks. A ladder of the main job's Llama sizes, each
size and layout its own torchrun launch of pipe_worker.py (``--stages 1`` for dp=2), a few ``train_batch`` steps of
AdamW, fp32; a size fits when every rank's peak RSS (``ru_maxrss``, which includes the Python process, torch and
the model's construction) stays within the budget. Measured, not enforced: each launch runs to its end.

Usage: python benchmarks/bench_pipeline_budget.py [--quick] [--budget MIB] [--sizes 6m,20m,60m,120m] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = (("pp=2 (zero 1F1B)", 0), ("dp=2, ZeRO-1", 1))  # (name, pipe_worker --stages)


def launch(size: str, stages: int, args, workdir: Path) -> list[dict] | str:
    out = workdir / f"{size}-{stages}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "pipe_worker.py"),
           "--impl", "zero", "--schedule", "1f1b", "--size", size, "--seq", str(args.seq), "--micro",
           str(args.micro), "--gas", str(args.gas), "--steps", str(args.steps), "--stages", str(stages),
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "failed")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> str:
    """Run the ladder; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=1024.0, help="peak RSS per rank, MiB")
    ap.add_argument("--quick", action="store_true", help="sizes 6m,20m unless --sizes")
    ap.add_argument("--sizes", default=None, help="default 6m,20m,60m,120m")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args(argv)
    args.sizes = args.sizes or ("6m,20m" if args.quick else "6m,20m,60m,120m")
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-pipe-budget-"))
    rows = ["| model | layout | peak RSS per rank MiB | fits | first loss | load average (1 min) at the end |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    largest = {name: "none" for name, _ in LAYOUTS}
    for size in args.sizes.split(","):
        for name, stages in LAYOUTS:
            print(f"bench pipeline budget: {size}, {name}", file=sys.stderr, flush=True)
            got = launch(size, stages, args, workdir)
            if isinstance(got, str):
                rows.append(f"| {size} | {name} | failed: {got} | | | |")
                continue
            peaks = [r["peak_rss_mib"] for r in got]
            fits = max(peaks) <= args.budget
            if fits:
                largest[name] = size
            rows.append(f"| {size} | {name} | {' / '.join(f'{p:.0f}' for p in peaks)} | {'yes' if fits else 'no'} "
                        f"| {got[0]['loss'][0]:.4f} | {got[0]['loadavg']:.1f} |")  # fmt: skip
    cmd = " ".join(["python benchmarks/bench_pipeline_budget.py", *(argv or sys.argv[1:])])
    head = (
        f"`{cmd}`: budget {args.budget:.0f} MiB peak RSS per rank; seq {args.seq}, micro-batch {args.micro}, "
        f"{args.gas} micro-batches per step, {args.steps} steps per launch; gloo on CPU, one thread per rank.\n\n"
    )
    tail = "\n\nLargest model within the budget: " + "; ".join(f"{n}: {largest[n]}" for n, _ in LAYOUTS) + ".\n"
    return head + "\n".join(rows) + tail


if __name__ == "__main__":
    print(main())
