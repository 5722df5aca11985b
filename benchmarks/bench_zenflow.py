"""ZenFlow: its training step against ZeRO-Offload's (``offload_optimizer`` cpu) at stage 2, and the loss each
reaches after the same steps on the same batches, in one run per table (zenflow_worker.py: the engines of a table
built from one model, trained in interleaved blocks). Two tables: from scratch, and fine-tuning a pre-trained model
(zenflow_pretrain.py: the same Llama trained in one process with plain torch AdamW on the batches before the ones
fine-tuned on, cached under runs/bench-cache/), the setting ZenFlow is made for.

Usage: python benchmarks/bench_zenflow.py [--quick] [--phases scratch,finetune] [--pretrain N] [--finetune N]
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
sys.path.insert(0, str(HERE))
from zenflow_pretrain import pretrained  # noqa: E402
from zenflow_worker import SETTINGS  # noqa: E402

SIZE, STEPS, PRETRAIN, FINETUNE, BLOCK = "6m", 120, 600, 120, 5
MICRO, SEQ = 2, 64  # a quarter of train_worker's 4 x 128 tokens: the runs fit this section's time
WORLD = 2
SCRATCH_ENGINES, FINETUNE_ENGINES = ("offload", "zenflow"), ("offload", "tutorial", "defaults")
LABELS = {
    "offload": "ZeRO-Offload (offload_optimizer cpu)",
    "zenflow": "ZenFlow, update_interval 4, topk 0.1 re-selected every 20 steps",
    "tutorial": "ZenFlow, DeepSpeed's tutorial config",
    "defaults": "ZenFlow, DeepSpeed's defaults (empty section)",
}


def run(steps: int, engines: tuple[str, ...], skip: int = 0, init: Path | None = None, size: str = SIZE) -> dict:
    """Launch zenflow_worker.py on 2 gloo ranks x 1 thread; rank 0's result."""
    out = Path(tempfile.mkdtemp(prefix="zero-bench-zenflow-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           str(HERE / "zenflow_worker.py"), "--size", size, "--steps", str(steps), "--skip", str(skip),
           "--init", str(init or ""), "--engines", ",".join(engines), "--block", str(BLOCK), "--micro", str(MICRO),
           "--seq", str(SEQ), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
        if proc.returncode != 0:
            raise RuntimeError(f"zenflow_worker exit {proc.returncode}: {proc.stderr.strip()[-1500:]}")
        return json.loads((out / "rank0.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)


def tail_ratio(r: dict, name: str) -> float:
    """Mean loss of ``name``'s last 10 steps over ZeRO-Offload's, minus 1."""
    tail = {k: statistics.fmean(r[k]["losses"][-10:]) for k in ("offload", name)}
    return tail[name] / tail["offload"] - 1


def settings_text(name: str) -> str:
    cfg = SETTINGS[name]
    return ", ".join(f"`{k}` {v}" for k, v in cfg.items()) if cfg else "the empty section `{}`"


def main(argv: list[str] | None = None) -> str:
    """Run the zenflow section; return markdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phases", default="scratch,finetune")
    ap.add_argument("--pretrain", type=int, default=PRETRAIN)
    ap.add_argument("--finetune", type=int, default=FINETUNE)
    ap.add_argument("--size", default=SIZE, choices=["6m", "20m"], help="model size (the main job's default: 20m)")
    args = ap.parse_args(argv)
    phases = args.phases.split(",")
    steps, pre, fine = (10, 20, 10) if args.quick else (STEPS, args.pretrain, args.finetune)
    size = args.size
    head = (f"Llama {size} (`zero train --model-size {size}`), {WORLD} gloo ranks x 1 thread, micro-batch {MICRO} x "
            f"{SEQ} tokens, fp32, AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.01), gradient_clipping 1.0, "
            "stage 2")  # fmt: skip
    text, verdicts, notes = "", [], []
    if "scratch" in phases:
        r = run(steps, SCRATCH_ENGINES, size=size)
        text += f"### ZenFlow vs ZeRO-Offload from scratch, {head}, {steps} steps\n\n{table(r, SCRATCH_ENGINES)}\n\n"
        verdicts.append(verdict("from scratch", r, "zenflow", steps))
        notes.append(f"from scratch: {host_text(r, 'zenflow')}")
    if "finetune" in phases:
        path, losses = pretrained(size, pre, MICRO * WORLD, SEQ)
        w = max(1, min(50, len(losses) // 2))  # two windows at the end: is the curve flat?
        r = run(fine, FINETUNE_ENGINES, skip=pre, init=path, size=size)
        text += (f"### ZenFlow vs ZeRO-Offload fine-tuning, {head}, {fine} steps from a pre-trained model\n\n"
                 f"Pre-training: the same model in one process, plain `torch.optim.AdamW` (same hyper-parameters, "
                 f"clipping 1.0), {pre} steps of the same {MICRO * WORLD} x {SEQ}-token global batches of the same "
                 f"text; mean loss of steps 1-10 {statistics.fmean(losses[:10]):.4f}, of steps {pre - 2 * w + 1}-"
                 f"{pre - w} {statistics.fmean(losses[-2 * w : -w]):.4f}, of steps {pre - w + 1}-{pre} "
                 f"{statistics.fmean(losses[-w:]):.4f}. Fine-tuning starts from its weights with fresh optimizer "
                 f"state, on the {fine} global batches that follow.\n\n{table(r, FINETUNE_ENGINES)}\n\n")  # fmt: skip
        for name in FINETUNE_ENGINES[1:]:
            verdicts.append(verdict(f"fine-tuning, {name}", r, name, fine))
            notes.append(f"fine-tuning, {name}: {host_text(r, name)}")
    used = [n for n in (SCRATCH_ENGINES if "scratch" in phases else ()) + FINETUNE_ENGINES if n != "offload"]
    cfgs = "; ".join(f"{n}: {settings_text(n)}" for n in dict.fromkeys(used))
    return (text + f"ZenFlow settings: {cfgs}. Host updates: {'; '.join(notes)}. Goal (ZenFlow's mean loss of the "
            f"last 10 steps at most 2% above ZeRO-Offload's): {'; '.join(verdicts)}. The engines of a table are built "
            f"from one model in one pair of processes and trained on the same batches in interleaved blocks of "
            f"{BLOCK} steps (medians without the first step; before each block every other engine's host step in "
            "flight is waited for, untimed). On this CPU-only machine the \"device\" is the same CPU: ZenFlow's "
            "device step of the selected columns, its gradient copy to the host accumulator and its worker's host "
            "step share the 2 cores with both ranks.\n")  # fmt: skip


def verdict(what: str, r: dict, name: str, steps: int) -> str:
    """The goal bounds how much worse ZenFlow may be: a lower loss meets it, said as such."""
    rel = tail_ratio(r, name)
    below = " (lower than ZeRO-Offload's)" if rel < -0.02 else ""
    return f"{what} ({steps} steps) {'meets' if rel <= 0.02 else 'misses'} it, {rel:+.1%}{below}"


def host_text(r: dict, name: str) -> str:
    return (f"{r[name]['host_updates']}, the most any lagged behind its last gradient {r[name]['max_lag']} steps "
            "(bound: its update interval)")  # fmt: skip


def table(r: dict, engines: tuple[str, ...]) -> str:
    """One table: per engine median step time, its ratio, the losses and the last-10 mean vs ZeRO-Offload."""
    steps = len(r["offload"]["losses"])
    last = min(10, steps)
    med = {k: statistics.median(r[k]["step_s"][1:]) for k in engines}
    tail = {k: statistics.fmean(r[k]["losses"][-last:]) for k in engines}
    rows = [f"| engine | median s/step | ratio vs ZeRO-Offload | loss at step 1 | loss at step {steps} | mean loss "
            f"of the last {last} steps | vs ZeRO-Offload | at most +2% |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for k in engines:
        rel = (tail[k] - tail["offload"]) / tail["offload"]
        ok = "-" if k == "offload" else ("yes" if rel <= 0.02 else "no")
        rows.append(f"| {LABELS[k]} | {med[k]:.3f} | {med[k] / med['offload']:.2f}x | {r[k]['losses'][0]:.4f} | "
                    f"{r[k]['losses'][-1]:.4f} | {tail[k]:.4f} | {rel:+.1%} | {ok} |")  # fmt: skip
    return "\n".join(rows)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
