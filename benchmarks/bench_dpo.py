"""A DPO step on 2 gloo ranks, zero against DeepSpeed 0.19.8: a ZeRO-3 policy with AdamW and a frozen ZeRO-3 reference
built through ``initialize()`` without an optimizer (dpo_worker.py), same config, data and loss. Step time from
interleaved rounds (every second round reversed), and the losses of the first steps compared.

Usage: python benchmarks/bench_dpo.py [--quick] [--rounds N] [--size SIZE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_training import run_one

ORDER = ["deepspeed", "zero"]


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="6m")
    args = ap.parse_args(argv)
    steps = 3 if args.quick else 4
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-dpo-"))
    runs: dict = {impl: [] for impl in ORDER}
    for rnd in range(args.rounds):
        for impl in ORDER if rnd % 2 == 0 else ORDER[::-1]:
            print(f"bench dpo: round {rnd + 1} {impl}", file=sys.stderr, flush=True)
            runs[impl].append(run_one(impl, 3, args.size, steps, workdir, (), "dpo_worker.py"))
    rows = ["| implementation | median s/step | ratio vs DeepSpeed | initialize() s (both engines) "
            "| peak RSS/rank MiB | first losses |", "|---|---|---|---|---|---|"]  # fmt: skip
    ok = {k: v for k, v in runs.items() if all(isinstance(r, dict) for r in v)}

    def step(impl):  # median over every launch's steps, each launch's first dropped
        return statistics.median([t for r in ok[impl] for t in r["step_s"][1:]])

    for impl in ORDER:
        if impl not in ok:
            rows.append(f"| {impl} | failed: {next(r for r in runs[impl] if isinstance(r, str))} | | | | |")
            continue
        r = ok[impl][0]
        ratio = f"{step(impl) / step('deepspeed'):.2f}x" if "deepspeed" in ok else ""
        init_s = statistics.median(x["initialize_s"] for x in ok[impl])
        rows.append(f"| {impl} | {step(impl):.3f} | {ratio} | {init_s:.2f} "
                    f"| {max(x['peak_rss_bytes_max'] for x in ok[impl]) / 2**20:.0f} | "
                    f"{', '.join(f'{x:.5f}' for x in r['losses'][:4])} |")  # fmt: skip
    params = next((v[0]["params"] for v in ok.values()), "?")
    lines = [
        f"Llama {args.size} from a config ({params} params) as the policy and, from the same seeded weights, as the "
        f"frozen reference; both ZeRO-3 on 2 gloo ranks x 1 thread, fp32; per rank 2 prompts of 64 tokens, each "
        f"with a chosen and a rejected 64-token response (4 rows of 128 through each model per step); policy "
        f"AdamW lr 3e-4, betas (0.9, 0.95), weight_decay 0.01, gradient_clipping 1.0; DPO sigmoid loss, beta 0.1, "
        f"written out in dpo_worker.py. A step: the reference's forward under `no_grad`, the policy's forward, "
        f"backward and step. Median over {args.rounds} interleaved round(s) of {steps} steps (each launch's "
        "first dropped). DeepSpeed's keys identical; zero adds its own `stage3_unit_numel` (one unit per decoder "
        "layer), as in the training section.\n",
        "\n".join(rows),
    ]
    if len(ok) == 2:
        z, d = ok["zero"][0]["losses"], ok["deepspeed"][0]["losses"]
        rel = [abs(a - b) / abs(b) for a, b in zip(z, d)]
        lines.append(f"\nLosses of the first {len(rel)} steps, zero vs DeepSpeed: largest relative difference "
                     f"{max(rel):.2e} (step {rel.index(max(rel)) + 1}).")  # fmt: skip
        lines.append(f"zero / DeepSpeed step time: {step('zero') / step('deepspeed'):.2f}x.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
