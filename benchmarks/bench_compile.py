"""Compiled ZeRO (zero_compile's DeepCompile-style passes, inductor) vs ZeRO eager vs ZeRO with plain torch_compile of
the module, at stages 3 and 1, in one run; all-gathers per optimizer step at accumulation 4 with selective unsharding.

Every configuration runs under torchrun on 2 gloo ranks x 1 thread (compile_worker.py) on the main job's Llama. The
first optimizer step holds compilation and is reported apart; step medians come from the steps after warm-up (2
profiled steps, then the planned passes compile once more: the third step is dropped too). DeepSpeed's DeepCompile
cannot run without CUDA, so it has no row here.

Usage: python benchmarks/bench_compile.py [--quick] [--out DIR]
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

HERE = Path(__file__).resolve().parent
MODES = ("eager", "torch_compile", "deepcompile")


def run_one(mode: str, stage: int, acc: int, size: str, steps: int, workdir: Path) -> dict | str:
    """Launch one configuration; return rank 0's result dict, or the error text."""
    out = workdir / f"{mode}-{stage}-{acc}-{size}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "compile_worker.py"),
           "--mode", mode, "--stage", str(stage), "--acc", str(acc), "--size", size, "--steps", str(steps),
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    except subprocess.TimeoutExpired:
        return "timed out after 1200 s"
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "")
    return json.loads((out / "rank0.json").read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return markdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model, fewer steps (counts, not speed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size, steps = ("tiny", 5) if args.quick else ("20m", 7)
    workdir = Path(args.out or tempfile.mkdtemp(prefix="zero-bench-compile-"))
    results = {}
    for stage in (3, 1):
        for mode in MODES:
            print(f"bench compile: stage {stage} {mode}", file=sys.stderr, flush=True)
            results[(stage, mode, 1)] = run_one(mode, stage, 1, size, steps, workdir)
    for mode in ("eager", "deepcompile"):
        results[(3, mode, 4)] = run_one(mode, 3, 4, size, 4, workdir)
    rows = [
        "| stage | mode | first step s (compile) | median s/step after warm-up | ratio vs faster baseline "
        "| all-gathers/step | graphs compiled after warm-up | last loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for stage in (3, 1):
        base = [results[(stage, m, 1)] for m in ("eager", "torch_compile")]
        best = min((_median(r["step_s"][3:]) for r in base if isinstance(r, dict)), default=float("nan"))
        for mode in MODES:
            r = results[(stage, mode, 1)]
            if not isinstance(r, dict):
                rows.append(f"| {stage} | {mode} | failed: {r} | | | | | |")
                continue
            med = _median(r["step_s"][3:])
            late = sum(1 for s in r["graphs_compiled_by_step"] if s > 2)
            rows.append(f"| {stage} | {mode} | {r['step_s'][0]:.2f} | {med:.3f} | {med / best:.2f}x "
                        f"| {_median(r['gathers'][3:]):.0f} | {late if mode == 'deepcompile' else '-'} "
                        f"| {r['losses'][-1]:.4f} |")  # fmt: skip
    acc_rows = ["| stage 3, accumulation 4 | all-gathers per optimizer step (steps 1, 2 warm-up; 3, 4 planned) |",
                "|---|---|"]  # fmt: skip
    for mode in ("eager", "deepcompile"):
        r = results[(3, mode, 4)]
        acc_rows.append(f"| {mode} | {r['gathers'] if isinstance(r, dict) else 'failed: ' + r} |")
    (workdir / "results.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    text = "\n".join([f"### Llama {size}, 2 gloo ranks x 1 thread, micro-batch 4 x 128, fp32, AdamW, inductor", "",
                      *rows, "", *acc_rows, ""])  # fmt: skip
    (workdir / "compile.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main())
