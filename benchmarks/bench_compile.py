"""Compiled ZeRO (zero_compile's DeepCompile-style passes, inductor) vs ZeRO eager vs ZeRO with plain torch_compile of
the module, at stages 3 and 1, in one run; all-gathers per optimizer step at accumulation 4 with selective unsharding.

Every configuration runs under torchrun on 2 gloo ranks x 1 thread (compile_worker.py) on the main job's Llama. The
first optimizer step holds compilation and is reported apart; step medians come from the steps after warm-up (2
profiled steps, then the planned passes compile once more: the third step is dropped too). DeepSpeed 0.19.8 stage 3
eager runs in the same run (train_worker.py, same model, data and optimizer); its DeepCompile needs CUDA, so it has
no row here. A "floor" row runs plain torch.compile of the model's forward and backward alone on each rank (no
ZeRO, optimizer or collective): the compute every mode runs, which bounds from below what any pass over the ZeRO
step can reach (its ratio column is floor / faster baseline). Each configuration's result is kept in ``--out`` as
it finishes (``<config>/rank0.json``).

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
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)
        lines = proc.stderr.strip().splitlines()
        lines = [ln for ln in lines if ln.startswith("[rank") and "Error:" in ln] or lines  # a rank's own error
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "")
    return json.loads((out / "rank0.json").read_text())


def run_deepspeed(stage: int, size: str, steps: int, workdir: Path) -> dict | str:
    """DeepSpeed 0.19.8 eager at ``stage`` (train_worker.py); rank 0's result dict, or the error text."""
    out = workdir / f"deepspeed-{stage}-{size}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "train_worker.py"),
           "--impl", "deepspeed", "--stage", str(stage), "--size", size, "--steps", str(steps),
           "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    except subprocess.TimeoutExpired:
        return "timed out after 1200 s"
    if proc.returncode != 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)
        lines = proc.stderr.strip().splitlines()
        lines = [ln for ln in lines if ln.startswith("[rank") and "Error:" in ln] or lines  # a rank's own error
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "")
    return json.loads((out / "rank0.json").read_text())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _first(r: dict) -> str:
    """The first three step times: compilation lands in one of them (torch_compile at stage 3 runs its first,
    checked forward eagerly and compiles in step 2; deepcompile traces in step 1 and runs inductor in step 3)."""
    return " / ".join(f"{s:.1f}" for s in r["step_s"][:3])


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return markdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model, fewer steps (counts, not speed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size, steps = ("tiny", 5) if args.quick else ("20m", 7)
    workdir = Path(args.out or tempfile.mkdtemp(prefix="zero-bench-compile-"))
    print(f"bench compile: results kept in {workdir}", file=sys.stderr, flush=True)
    results = {}
    print("bench compile: floor", file=sys.stderr, flush=True)
    floor = run_one("floor", 3, 1, size, steps, workdir)
    for stage in (3, 1):
        for mode in MODES:
            print(f"bench compile: stage {stage} {mode}", file=sys.stderr, flush=True)
            results[(stage, mode, 1)] = run_one(mode, stage, 1, size, steps, workdir)
        if stage == 3:
            print("bench compile: stage 3 deepspeed", file=sys.stderr, flush=True)
            results[(3, "deepspeed", 1)] = run_deepspeed(3, size, steps, workdir)
    for mode in ("eager", "deepcompile"):
        results[(3, mode, 4)] = run_one(mode, 3, 4, size, 4, workdir)
    ds = results.get((3, "deepspeed", 1))
    ds_med = _median(ds["step_s"][3:]) if isinstance(ds, dict) else float("nan")
    rows = [
        "| stage | mode | steps 1 / 2 / 3 s (compile) | median s/step after warm-up | ratio vs faster baseline "
        "| ratio vs DeepSpeed stage 3 eager | all-gathers/step | graphs compiled after warm-up | last loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stage in (3, 1):
        base = [results[(stage, m, 1)] for m in ("eager", "torch_compile")]
        best = min((_median(r["step_s"][3:]) for r in base if isinstance(r, dict)), default=float("nan"))
        for mode in MODES:
            r = results[(stage, mode, 1)]
            if not isinstance(r, dict):
                rows.append(f"| {stage} | {mode} | failed: {r} | | | | | | |")
                continue
            med = _median(r["step_s"][3:])
            late = sum(1 for s in r["graphs_compiled_by_step"] if s > 2)
            vs_ds = f"{med / ds_med:.2f}x" if stage == 3 else "-"
            rows.append(f"| {stage} | {mode} | {_first(r)} | {med:.3f} | {med / best:.2f}x | {vs_ds} "
                        f"| {_median(r['gathers'][3:]):.0f} | {late if mode == 'deepcompile' else '-'} "
                        f"| {r['losses'][-1]:.4f} |")  # fmt: skip
        if isinstance(floor, dict):
            fm = _median(floor["step_s"][3:])
            rows.append(f"| {stage} | floor: compiled forward + backward only | {_first(floor)} | {fm:.3f} "
                        f"| {fm / best:.2f}x | - | 0 | - | - |")  # fmt: skip
        else:
            rows.append(f"| {stage} | floor | failed: {floor} | | | | | | |")
        if stage == 3:
            if isinstance(ds, dict):
                rows.append(f"| 3 | DeepSpeed 0.19.8 eager | {_first(ds)} | {ds_med:.3f} "
                            f"| {ds_med / best:.2f}x | 1.00x | - | - | {ds['losses'][-1]:.4f} |")  # fmt: skip
            else:
                rows.append(f"| 3 | DeepSpeed 0.19.8 eager | failed: {ds} | | | | | | |")
    acc_rows = ["| stage 3, accumulation 4 | all-gathers per optimizer step (steps 1, 2 warm-up; 3, 4 planned) |",
                "|---|---|"]  # fmt: skip
    for mode in ("eager", "deepcompile"):
        r = results[(3, mode, 4)]
        acc_rows.append(f"| {mode} | {r['gathers'] if isinstance(r, dict) else 'failed: ' + r} |")
    results[(0, "floor", 1)] = floor
    (workdir / "results.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    text = "\n".join([f"### Llama {size}, 2 gloo ranks x 1 thread, micro-batch 4 x 128, fp32, AdamW, inductor", "",
                      *rows, "", *acc_rows, ""])  # fmt: skip
    (workdir / "compile.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main())
