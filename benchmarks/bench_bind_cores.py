"""Effect of ``--bind_cores_to_rank`` on the main job: ``zero train`` (its default model and config, 2 ranks) with
each rank pinned to one core vs the same job unpinned (the peer), alternating so drift of this shared machine hits
both. Reports the median optimizer-step time from rank 0's ``log.jsonl`` (the first 2 steps, warm-up, dropped).

Usage: python benchmarks/bench_bind_cores.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_job(runs: Path, name: str, steps: int, pinned: bool) -> list[float]:
    """One ``zero train`` launch; returns rank 0's seconds per optimizer step (warm-up steps dropped)."""
    cmd = [sys.executable, "-m", "zero.cli", "train", "--runs-dir", str(runs), "--name", name, "--steps", str(steps),
           "--max-data-mb", "2", "--val-windows", "4", "--nproc-per-node", "2"]  # fmt: skip
    if pinned:
        cmd.append("--bind-cores-to-rank")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # zero train: cores / ranks = 1 each
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"zero train {'pinned' if pinned else 'unpinned'} failed: {proc.stderr[-1500:]}")
    records = [json.loads(line) for line in (runs / name / "log.jsonl").read_text().splitlines()]
    return [r["step_s"] for r in records][2:]


def main(argv: list[str]) -> str:
    """Markdown: per-round medians and the pinned / unpinned ratio of median step times."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    rounds, steps = (1, 8) if args.quick else (2, 14)
    times: dict[bool, list[float]] = {False: [], True: []}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for pinned in (False, True):
                step_s = run_job(Path(tmp), f"r{r}-{int(pinned)}", steps, pinned)
                times[pinned] += step_s
                rows.append(f"| {r + 1} | {'pinned, 1 core per rank' if pinned else 'unpinned (peer)'} | "
                            f"{len(step_s)} | {statistics.median(step_s):.3f} |")  # fmt: skip
    free, pin = statistics.median(times[False]), statistics.median(times[True])
    load = os.getloadavg()[0]
    return "\n".join([
        f"`zero train` defaults (20m Llama, ZeRO-3, 2 ranks, 1 thread each), {steps} steps per launch, {rounds} "
        f"round(s), pinned and unpinned alternating; load average at the end {load:.1f} (other engineers' jobs "
        "share these 2 cores, so the ratio is what to read).",
        "",
        "| round | ranks | steps timed | median step (s) |",
        "|---|---|---|---|",
        *rows,
        "",
        f"**Pinned / unpinned median step time: {pin / free:.2f}x** ({pin:.3f} s vs {free:.3f} s; below 1 means "
        "pinning is faster).",
    ])  # fmt: skip


if __name__ == "__main__":
    print(main(sys.argv[1:]))
