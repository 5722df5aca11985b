"""ZenFlow: its training step against ZeRO-Offload's (``offload_optimizer`` cpu) at stage 2, and the loss both reach
after the same steps on the same batches, in one run (zenflow_worker.py: two engines, interleaved blocks).

Usage: python benchmarks/bench_zenflow.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIZE, STEPS, BLOCK = "6m", 40, 5


def run(size: str, steps: int, block: int) -> dict:
    """Launch zenflow_worker.py on 2 gloo ranks x 1 thread; rank 0's result."""
    out = Path(tempfile.mkdtemp(prefix="zero-bench-zenflow-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "zenflow_worker.py"),
           "--size", size, "--steps", str(steps), "--block", str(block), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"zenflow_worker exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        return json.loads((out / "rank0.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> str:
    """Run the zenflow section; return markdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = 10 if args.quick else STEPS
    res = run(SIZE, steps, BLOCK)
    off, zen = res["offload"], res["zenflow"]
    med = {k: statistics.median(r["step_s"][1:]) for k, r in (("offload", off), ("zenflow", zen))}
    last = min(10, steps)
    tail = {k: statistics.fmean(r["losses"][-last:]) for k, r in (("offload", off), ("zenflow", zen))}
    rows = [f"| engine | median s/step | ratio vs ZeRO-Offload | loss at step 1 | loss at step {steps} | mean loss "
            f"of the last {last} steps | vs ZeRO-Offload |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in (("ZeRO-Offload (offload_optimizer cpu)", off), ("ZenFlow (same + zenflow)", zen)):
        k = "offload" if r is off else "zenflow"
        rel = (tail[k] - tail["offload"]) / tail["offload"]
        rows.append(f"| {name} | {med[k]:.3f} | {med[k] / med['offload']:.2f}x | {r['losses'][0]:.4f} | "
                    f"{r['losses'][-1]:.4f} | {tail[k]:.4f} | {rel:+.1%} |")  # fmt: skip
    zen_cfg = ", ".join(f"`{k}` {v}" for k, v in __import__("zenflow_worker").ZENFLOW.items())
    return (f"### ZenFlow vs ZeRO-Offload, Llama {SIZE} (`zero train --model-size {SIZE}`), 2 gloo ranks x 1 thread, "
            f"fp32, AdamW, stage 2, {steps} steps\n\n" + "\n".join(rows) + "\n\n"
            f"ZenFlow: {zen_cfg}; {res['host_updates']} host updates, the most any lagged behind its last "
            f"gradient: {res['max_lag']} steps (bound: `update_interval`). Both engines are built from one initial "
            f"model in one pair of processes and trained on the same batches in interleaved blocks of {BLOCK} "
            "steps (medians without the first step; before each block the other engine's host step in flight is "
            "waited for, untimed). On this CPU-only machine the \"device\" is the same CPU: ZenFlow's device step "
            "of the selected columns, its gradient copy to the host accumulator and its worker's host step share "
            "the 2 cores with both ranks. The main job's 20m model at 120 steps per engine does not fit the ~10 "
            f"minutes this section may take on this shared machine (13-20 s a step at load 12), hence {SIZE} "
            f"and {steps} steps.\n")  # fmt: skip


if __name__ == "__main__":
    print(main(sys.argv[1:]))
