"""ZenFlow: its training step against ZeRO-Offload's (``offload_optimizer`` cpu) at stage 2, and the loss both reach
after the same steps on the same batches, in one run (zenflow_worker.py: two engines, interleaved blocks), from
scratch and then fine-tuning from the weights ZeRO-Offload reached (fresh optimizer state for both).

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
SIZE, STEPS, FINETUNE, BLOCK = "6m", 40, 60, 5


def run(size: str, steps: int, finetune: int, block: int) -> dict:
    """Launch zenflow_worker.py on 2 gloo ranks x 1 thread; rank 0's result."""
    out = Path(tempfile.mkdtemp(prefix="zero-bench-zenflow-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / "zenflow_worker.py"),
           "--size", size, "--steps", str(steps), "--finetune", str(finetune), "--block", str(block),
           "--out", str(out)]  # fmt: skip
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
    steps, finetune = (10, 10) if args.quick else (STEPS, FINETUNE)
    res = run(SIZE, steps, finetune, BLOCK)
    scratch, fine = res["scratch"], res["finetune"]
    zen_cfg = ", ".join(f"`{k}` {v}" for k, v in __import__("zenflow_worker").ZENFLOW.items())
    head = f"Llama {SIZE} (`zero train --model-size {SIZE}`), 2 gloo ranks x 1 thread, fp32, AdamW, stage 2"
    return (f"### ZenFlow vs ZeRO-Offload from scratch, {head}, {steps} steps\n\n{table(scratch)}\n\n"
            f"### ZenFlow vs ZeRO-Offload fine-tuning, {head}: {finetune} more steps from the weights ZeRO-Offload "
            f"reached above\n\n{table(fine)}\n\n"
            f"ZenFlow: {zen_cfg}; from scratch {scratch['host_updates']} host updates, fine-tuning "
            f"{fine['host_updates']}; the most any lagged behind its last gradient: "
            f"{max(scratch['max_lag'], fine['max_lag'])} steps (bound: `update_interval`). In each phase both "
            "engines are built from one model in one pair of processes and trained on the same batches in "
            f"interleaved blocks of {BLOCK} steps (medians without the first step; before each block the other "
            "engine's host step in flight is waited for, untimed). Fine-tuning: both engines start from ZeRO-Offload's "
            f"weights after the {steps} from-scratch steps, with fresh optimizer state (ZenFlow's target: a "
            f"pretrained model), on the {finetune} batches that follow. On this CPU-only machine the \"device\" is "
            "the same CPU: ZenFlow's device step of the selected columns, its gradient copy to the host accumulator "
            "and its worker's host step share the 2 cores with both ranks. The main job's 20m model at 120 steps per "
            "engine does not fit the ~10 minutes this section may take on this shared machine (13-20 s a step at "
            f"load 12), hence {SIZE} and {steps} + {finetune} steps.\n")  # fmt: skip


def table(r: dict) -> str:
    """One phase's markdown table: median step time, its ratio, the losses and the last-10 mean vs ZeRO-Offload."""
    steps = len(r["offload"]["losses"])
    last = min(10, steps)
    med = {k: statistics.median(r[k]["step_s"][1:]) for k in ("offload", "zenflow")}
    tail = {k: statistics.fmean(r[k]["losses"][-last:]) for k in ("offload", "zenflow")}
    rows = [f"| engine | median s/step | ratio vs ZeRO-Offload | loss at step 1 | loss at step {steps} | mean loss "
            f"of the last {last} steps | vs ZeRO-Offload | within 2% |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, k in (("ZeRO-Offload (offload_optimizer cpu)", "offload"), ("ZenFlow (same + zenflow)", "zenflow")):
        rel = (tail[k] - tail["offload"]) / tail["offload"]
        ok = "-" if k == "offload" else ("yes" if abs(rel) <= 0.02 else "no")
        rows.append(f"| {name} | {med[k]:.3f} | {med[k] / med['offload']:.2f}x | {r[k]['losses'][0]:.4f} | "
                    f"{r[k]['losses'][-1]:.4f} | {tail[k]:.4f} | {rel:+.1%} | {ok} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
