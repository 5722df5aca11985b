"""Ulysses sequence parallelism on 2 gloo ranks (sp_worker.py): the longest sequence trainable under a per-rank peak
RSS budget (sp=2 with ALST's tiling and checkpoint offload vs sp=1 plain), peak RSS per rank against sequence length
(sp=1 vs sp=2), and the sp=2 ALST step of zero against DeepSpeed 0.19.8's own ``ulysses_sp`` on the same config.

The budget is checked by measuring, not enforced: a trial fits when the largest ``VmHWM`` of the 2 ranks over its
steps (reset before each trial, see sp_worker.py) is at most the budget. The search doubles the length from
``--start`` until a trial misses, then bisects to ``--grain`` positions.

Usage: python benchmarks/bench_sp.py [--quick] [--budget-mib MIB] [--size SIZE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_training import run_one

MIB = 2**20


def _fmt_trials(res: dict) -> str:
    return ", ".join(f"{r['seq']}: {r['peak_rss_bytes'] / MIB:.0f}" for r in res["runs"])


def main(argv: list[str] | None = None) -> str:
    """Run the measurements; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer lengths and steps")
    ap.add_argument("--size", default="6m")
    ap.add_argument("--budget-mib", type=float, default=640.0)
    ap.add_argument("--start", type=int, default=256)
    ap.add_argument("--grain", type=int, default=256)
    ap.add_argument("--longest", type=int, default=4096)
    ap.add_argument("--lengths", default="512,1024,2048", help="RSS against length")
    ap.add_argument("--time-seq", type=int, default=1024, help="sequence length of the zero vs DeepSpeed step")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    steps = 2
    lengths = "512,1024" if args.quick else args.lengths
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-sp-"))

    def launch(impl: str, sp: int, recipe: str, *extra: str) -> dict | str:
        print(f"bench sp: {impl} sp={sp} {recipe} {' '.join(extra)}", file=sys.stderr, flush=True)
        return run_one(impl, 3, args.size, steps, workdir, ("--sp", str(sp), "--recipe", recipe, *extra),
                       "sp_worker.py")  # fmt: skip

    search = ("--seqs", str(args.start), "--budget-mib", str(args.budget_mib), "--grain", str(args.grain),
              "--longest", str(args.longest))  # fmt: skip
    found = {key: launch("zero", sp, recipe, *search) for key, sp, recipe in (("sp1", 1, "plain"), ("sp2", 2, "alst"))}
    curves = {sp: launch("zero", sp, "plain", "--seqs", lengths, "--steps", "1") for sp in (1, 2)}
    timed: dict = {"deepspeed": [], "zero": []}
    for rnd in range(args.rounds):
        for impl in ("deepspeed", "zero") if rnd % 2 == 0 else ("zero", "deepspeed"):
            timed[impl].append(launch(impl, 2, "alst", "--seqs", str(args.time_seq)))

    budget = args.budget_mib * MIB
    lines = [f"Llama {args.size} (`zero train --model-size {args.size}`), fp32, ZeRO-3 (DeepSpeed's ALST recipes use "
             "ZeRO-3), AdamW, 2 gloo ranks x 1 thread, micro-batch 1. *sp=1 plain*: 2 data-parallel ranks, each its "
             "own sequence. *sp=2 ALST*: Ulysses attention (both ranks share one sequence), `TiledMLP` on every MLP, "
             "`TiledFusedLogitsLoss` on the head, non-reentrant gradient checkpointing of each decoder layer with the "
             "checkpointed hidden states in host memory (`get_checkpoint_hidden_states_offloading_ctx_manager`; on "
             "a CPU-only machine host memory is the same RAM, so this offload cannot lower RSS). *sp=2 plain*: "
             "Ulysses attention alone. Peak RSS per rank is `VmHWM` (the larger of the 2 ranks), reset before each "
             "trial; measured, not enforced.\n"]  # fmt: skip
    lines += [f"### Longest sequence under {args.budget_mib:.0f} MiB peak RSS per rank ({steps} steps per trial; "
              f"doubling from {args.start}, then bisecting to {args.grain} positions, at most {args.longest})\n",
              "| config | longest fitting sequence | trials (length: peak MiB) |", "|---|---|---|"]  # fmt: skip
    longest = {}
    for key, name in (("sp1", "sp=1 plain"), ("sp2", "sp=2 ALST")):
        res = found[key]
        if not isinstance(res, dict):
            lines.append(f"| {name} | failed: {res} | |")
            continue
        fits = [r["seq"] for r in res["runs"] if r["peak_rss_bytes"] <= budget]
        longest[key] = max(fits) if fits else None
        cap = " (cap reached)" if all(r["peak_rss_bytes"] <= budget for r in res["runs"]) else ""
        lines.append(f"| {name} | {longest[key] or 'none'}{cap} | {_fmt_trials(res)} |")
    if longest.get("sp1") and longest.get("sp2"):
        ratio = longest["sp2"] / longest["sp1"]
        lines.append(f"\nsp=2 ALST / sp=1 plain: {ratio:.1f}x the sequence length under the same budget (goal >= 4x: "
                     f"{'met' if ratio >= 4 else 'not met'}).")  # fmt: skip

    lines += ["\n### Peak RSS per rank against sequence length (1 step per length, MiB; 'above start' is the peak "
              "less the RSS before the trial: activations and gradients)\n",
              "| length | sp=1 plain peak | sp=1 above start | sp=2 plain peak | sp=2 above start | sp=1 / sp=2 above "
              "start |", "|---|---|---|---|---|---|"]  # fmt: skip
    if all(isinstance(c, dict) for c in curves.values()):
        by = {sp: {r["seq"]: r for r in c["runs"]} for sp, c in curves.items()}
        for seq in sorted(by[1]):
            a, b = by[1][seq], by[2].get(seq)
            if b is None:
                continue
            da, db = (
                (a["peak_rss_bytes"] - a["rss_before_bytes"]) / MIB,
                (b["peak_rss_bytes"] - b["rss_before_bytes"]) / MIB,
            )
            lines.append(f"| {seq} | {a['peak_rss_bytes'] / MIB:.0f} | {da:.0f} | {b['peak_rss_bytes'] / MIB:.0f} | "
                         f"{db:.0f} | {da / db:.2f}x |")  # fmt: skip
    else:
        lines.append(f"| failed: {[c for c in curves.values() if isinstance(c, str)]} | | | | | |")

    lines += [f"\n### sp=2 ALST step, zero vs DeepSpeed 0.19.8 (`deepspeed.runtime.sequence_parallel.ulysses_sp`), "
              f"sequence {args.time_seq}, {steps} steps x {args.rounds} round(s)\n",
              "| implementation | median s/step | ratio vs DeepSpeed | peak RSS/rank MiB | losses |",
              "|---|---|---|---|---|"]  # fmt: skip
    ok = {k: v for k, v in timed.items() if v and all(isinstance(r, dict) for r in v)}

    def med(impl: str) -> float:
        return statistics.median([t for r in ok[impl] for t in r["runs"][0]["step_s"]])

    for impl in ("deepspeed", "zero"):
        if impl not in ok:
            lines.append(f"| {impl} | failed: {next((r for r in timed[impl] if isinstance(r, str)), '?')} | | | |")
            continue
        ratio = f"{med(impl) / med('deepspeed'):.2f}x" if "deepspeed" in ok else ""
        losses = ", ".join(f"{x:.5f}" for x in ok[impl][0]["runs"][0]["losses"])
        lines.append(f"| {impl} | {med(impl):.2f} | {ratio} | {ok[impl][0]['peak_rss_bytes'] / MIB:.0f} | {losses} |")
    if len(ok) == 2:
        z, d = ok["zero"][0]["runs"][0]["losses"], ok["deepspeed"][0]["runs"][0]["losses"]
        rel = max(abs(a - b) / abs(b) for a, b in zip(z, d))
        ratio = med("zero") / med("deepspeed")
        lines.append(f"\nLosses, zero vs DeepSpeed: largest relative difference {rel:.2e}. zero / DeepSpeed step time: "
                     f"{ratio:.2f}x (goal <= 0.8x: {'met' if ratio <= 0.8 else 'not met'}).")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
