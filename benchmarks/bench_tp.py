"""Tensor parallelism (AutoTP) on 2 gloo ranks: zero's tp=2 against DeepSpeed 0.19.8's AutoTP training and against
zero's own dp=2 ZeRO-1 on the same model, data and AdamW (tp_worker.py), in one run. Reports the median step time
from interleaved rounds (every second round reversed), the model-state bytes each rank holds against their formula,
and the losses of the first steps of every configuration.

Usage: python benchmarks/bench_tp.py [--quick] [--rounds N] [--size SIZE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_training import run_one, zero_formula_bytes

# (implementation, mode); zero's tp run sits between its two peers so that drift of the machine hits all alike.
ORDER = [("deepspeed", "tp"), ("zero", "tp"), ("zero", "dp")]
NAMES = {("deepspeed", "tp"): "DeepSpeed tp=2 x dp=1, ZeRO-1", ("zero", "tp"): "zero tp=2 x dp=1, ZeRO-1",
         ("zero", "dp"): "zero dp=2, ZeRO-1"}  # fmt: skip


def formula_bytes(impl: str, mode: str, res: dict) -> float:
    """Model-state bytes per rank for fp32 training with Adam: at tp=2 x dp=1 each rank holds ``psi_tp`` =
    split/2 + replicated elements whole (params 4, grads 4, moments 8 bytes each; ZeRO over one data-parallel rank
    shards nothing); DeepSpeed also keeps an fp32 master copy (+4) even in fp32. At dp=2 ZeRO-1 (zero): the ZeRO
    paper's stage-1 formula. Padding is not included."""
    if mode == "dp":
        return zero_formula_bytes(1, res["params"], res["world"])
    psi_tp = res["split_params"] / 2 + res["replicated_params"]
    return (20 if impl == "deepspeed" else 16) * psi_tp


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round unless --rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    ap.add_argument("--size", default="6m")
    args = ap.parse_args(argv)
    steps = 4 if args.quick else 6
    args.rounds = args.rounds or (1 if args.quick else 2)
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-tp-"))
    runs: dict = {key: [] for key in ORDER}
    for rnd in range(args.rounds):
        for impl, mode in ORDER if rnd % 2 == 0 else ORDER[::-1]:
            print(f"bench tp: round {rnd + 1} {impl} {mode}", file=sys.stderr, flush=True)
            runs[(impl, mode)].append(run_one(impl, 1, args.size, steps, workdir, ("--mode", mode), "tp_worker.py"))
    ok = {k: v for k, v in runs.items() if all(isinstance(r, dict) for r in v)}

    def step(key):  # median over every launch's steps, each launch's first dropped
        return statistics.median([t for r in ok[key] for t in r["step_s"][1:]])

    rows = ["| configuration | median s/step | vs DeepSpeed tp=2 | vs zero dp=2 | initialize() s | params/rank "
            "| model-state MiB/rank: params + grads + master + optimizer = total | formula MiB | measured/formula "
            "| peak RSS/rank MiB | first losses |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key in ORDER:
        if key not in ok:
            rows.append(f"| {NAMES[key]} | failed: {next(r for r in runs[key] if isinstance(r, str))} |" + " |" * 9)
            continue
        r = ok[key][0]
        vs = [f"{step(key) / step(peer):.2f}x" if peer in ok else "" for peer in (("deepspeed", "tp"), ("zero", "dp"))]
        s = r["model_state_bytes"]
        parts = " + ".join(f"{s[k] / 2**20:.1f}" for k in ("params", "grads", "master", "optimizer"))
        formula = formula_bytes(*key, r)
        init_s = statistics.median(x["initialize_s"] for x in ok[key])
        rss = max(x["peak_rss_bytes_max"] for x in ok[key]) / 2**20
        rows.append(f"| {NAMES[key]} | {step(key):.3f} | {vs[0]} | {vs[1]} | {init_s:.2f} | {r['local_params']} "
                    f"| {parts} = {s['total'] / 2**20:.1f} | {formula / 2**20:.1f} | {s['total'] / formula:.4f} "
                    f"| {rss:.0f} | {', '.join(f'{x:.5f}' for x in r['losses'][:4])} |")  # fmt: skip
    r0 = next((ok[k][0] for k in (("zero", "tp"), *ORDER) if k in ok), None)  # zero counts what it split
    head = (f"Llama {args.size} (`zero train --model-size {args.size}`, {r0['params'] if r0 else '?'} params"
            + (f"; {r0['split_params']} of them split" if r0 else "")
            + "), 2 gloo ranks x 1 thread, fp32, torch AdamW (lr 3e-4, betas (0.9, 0.95), weight_decay 0.01), "
            "gradient_clipping 1.0, global batch 4 x 128 tokens per step (tp: both ranks the whole batch; dp: each "
            "its half), `tensor_parallel: {autotp_size: 2, preset_model: llama}` and ZeRO-1 for both "
            f"implementations. Median over {args.rounds} interleaved round(s) of {steps} steps (each launch's first "
            "dropped). Model state: what each rank holds after the last step (zero: its runtime's own accounting; "
            "DeepSpeed: module parameters, fp32 master partitions, the inner optimizer's state, and the gradients "
            "held after the last backward). Formula: 16 bytes per element a rank holds at tp=2 x dp=1 (split/2 + "
            "replicated elements; 20 for DeepSpeed, whose fp32 master copy is separate), the ZeRO paper's "
            "4 + 4 + 8/2 = 12 per element at dp=2 ZeRO-1.\n")  # fmt: skip
    lines = [head, "\n".join(rows)]
    if ("zero", "tp") in ok:
        z = ok[("zero", "tp")][0]["losses"]
        for peer in (("deepspeed", "tp"), ("zero", "dp")):
            if peer in ok:
                p = ok[peer][0]["losses"]
                rel = [abs(a - b) / abs(b) for a, b in zip(z, p)]
                lines.append(f"\nLosses of the first {len(rel)} steps, zero tp=2 vs {NAMES[peer]}: largest relative "
                             f"difference {max(rel):.2e} (step {rel.index(max(rel)) + 1}).")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
