"""ZeRO-Inference: zero's stage-3 engine built without an optimizer on 2 gloo ranks against the dense model loaded in
each rank: peak RSS growth per rank (against its formula) and forward time, in one interleaved run.

Each configuration is a launch of infer_worker.py; the sequence runs ``--rounds`` times, every second round reversed
(ABBA). RSS growth: a rank's peak RSS minus its RSS just before the model is built (torch, transformers and zero
already imported), the larger of the 2 ranks, the largest over the rounds.

Usage: python benchmarks/bench_inference.py [--quick] [--rounds N] [--size SIZE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_training import run_one
from train_worker import UNIT_NUMEL

# (impl, stage3_max_live_parameters): one decoder layer live at a time, and DeepSpeed's default (prefetch on).
ORDER = [("dense", 0), ("zero", UNIT_NUMEL), ("zero", 1_000_000_000)]


# What the figures are made of (instrumented runs of one rank, reported with the section; printed with the verdict).
CAUSE = (
    "Where the memory goes, from runs of one rank with VmRSS/VmHWM read around each phase: (1) building the model "
    "under `zero.Init` used to hold it whole on each rank until `LlamaForCausalLM.__init__` returned (zero_init "
    "partitioned once the outermost construction returned, so that `post_init`'s weight initialisation could still "
    "edit every weight; fixed: each module is partitioned as its `__init__` returns, as DeepSpeed does, and a "
    "write into a partitioned weight, such as `post_init`'s, gathers that one weight, applies and partitions it "
    "again, so the build holds the shard plus one module's weights and a partition's transient copy); (2) the "
    "full values freed by partitioning used to stay resident until `initialize`: "
    "glibc was given them back only after a single module freed 4 MiB, and no module of this model does (fixed: "
    "counted across the construction); (3) glibc raises its mmap threshold to the size of every mapped block freed, "
    "so once a unit's 15 MiB buffer was released every activation came from the heap, whose freed pages stayed "
    "resident: the engine's forward grew about 110 MiB instead of 45 (fixed: zero pins glibc's thresholds at their "
    "starting value, 128 KiB; the dense peer here runs with the same setting). With one unit live, what remains "
    "is the shard, one gathered decoder layer and the forward's own allocations. With the default "
    "`stage3_max_live_parameters` (1e9) the prefetch fetches up to `stage3_prefetch_bucket_size` (5e7 elements, "
    "DeepSpeed's default) ahead, which is this whole model: DeepSpeed 0.19.8's coordinator does the same "
    "(`min(max_live - available, prefetch_bucket_size)` elements per fetch once its trace is complete), so the "
    "default is kept; bound `stage3_max_live_parameters` to serve within the formula."
)


def _label(impl: str, max_live: int) -> str:
    if impl == "dense":
        return "dense model in each rank"
    return "zero ZeRO-3 engine, " + ("one unit live" if max_live == UNIT_NUMEL else "max_live 1e9 (default)")


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer forwards")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="60m")
    args = ap.parse_args(argv)
    steps = 3 if args.quick else 4
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-infer-"))
    runs: dict = {key: [] for key in ORDER}
    for rnd in range(args.rounds):
        for impl, max_live in ORDER if rnd % 2 == 0 else ORDER[::-1]:
            print(f"bench inference: round {rnd + 1} {impl} max_live {max_live}", file=sys.stderr, flush=True)
            extra = ("--max-live", str(max_live)) if impl == "zero" else ()
            runs[(impl, max_live)].append(run_one(impl, 3, args.size, steps, workdir, extra, "infer_worker.py"))
    failed = {
        k: next(r for r in v if isinstance(r, str)) for k, v in runs.items() if any(isinstance(r, str) for r in v)
    }
    ok = {k: v for k, v in runs.items() if k not in failed}

    def fwd(key):  # median forward seconds over every launch's forwards, each launch's first dropped
        return statistics.median([t for r in ok[key] for t in r["step_s"][1:]])

    def most(key, field):  # the largest over the rounds (each launch: the larger of the 2 ranks)
        return max(r[field] for r in ok[key])

    first = next((v[0] for v in ok.values()), None)
    if first is None:
        return "All configurations failed:\n\n" + "\n".join(f"- {_label(*k)}: {e}" for k, e in failed.items())
    psi, unit, n = first["params"], first["largest_unit"], first["world"]
    weights = 4 * psi
    formula = weights / n + 4 * unit
    dense = ("dense", 0) if ("dense", 0) in ok else None
    # the dense forward's own allocations: its serving peak above its RSS once built
    fwd_alloc = most(dense, "serve_growth_bytes") - most(dense, "serve_start_bytes") if dense else 0.0
    mib = 2**20
    rows = ["| config | median forward s | vs dense | build peak growth/rank MiB | serving peak growth/rank MiB "
            "| serving growth - dense forward allocations MiB | vs formula | logits equal dense |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for key in ORDER:
        if key in failed:
            rows.append(f"| {_label(*key)} | failed: {failed[key]} | | | | | | |")
            continue
        res = ok[key][0]
        vs_dense = f"{fwd(key) / fwd(dense):.2f}x" if dense else ""
        serve = most(key, "serve_growth_bytes")
        beyond = serve - fwd_alloc
        vs_formula = f"{beyond / formula:.2f}x" if key[0] == "zero" else ""
        same = str(res["logit_sums"] == ok[dense][0]["logit_sums"]).lower() if dense else ""
        rows.append(f"| {_label(*key)} | {fwd(key):.3f} | {vs_dense} | {most(key, 'build_growth_bytes') / mib:.1f} | "
                    f"{serve / mib:.1f} | {beyond / mib:.1f} | {vs_formula} | {same} |")  # fmt: skip
    lines = [
        f"Llama {args.size} from a config ({psi} params, fp32: {weights / mib:.1f} MiB of weights; largest "
        f"unit: a decoder layer of {unit} params, `stage3_unit_numel` {UNIT_NUMEL}; the embedding and the head "
        f"are far smaller), frozen, `torch.no_grad()` forwards of micro-batch 2 x 128 on {n} gloo ranks x 1 thread; "
        f"median over {args.rounds} interleaved round(s) of {steps} forwards (each launch's first dropped). zero "
        "builds the model under `zero.zero.Init` (partitioned as constructed) and `zero.initialize(model=..., "
        "config=...)` without an optimizer.\n",
        f"Formula for the engine's weights per rank: 4 psi / N + 4 unit = {weights / mib:.1f} / {n} + "
        f"{4 * unit / mib:.1f} = {formula / mib:.1f} MiB (the rank's shard plus one gathered decoder layer, the "
        "largest unit gathered; norm weights stay whole, a few KiB). RSS growth is from each rank's RSS before the "
        "model is built (torch, transformers, zero and the Llama modeling code already imported); per phase, the "
        "peak since the phase began: the build, then serving (`initialize` and the forwards). The dense model's "
        f"forward allocates {fwd_alloc / mib:.1f} MiB beyond its built RSS (its serving peak minus its RSS once "
        "built); the engine pays the same, so its serving growth minus that is what the formula predicts.\n",
        "\n".join(rows),
    ]
    if dense:
        best = min((k for k in ORDER[1:] if k in ok), key=lambda k: most(k, "serve_growth_bytes"), default=None)
        if best is not None:
            beyond = most(best, "serve_growth_bytes") - fwd_alloc
            build = most(best, "build_growth_bytes")
            peak = max(build, beyond)

            def verdict(x: float) -> str:
                return "meets" if x <= 1.25 * formula else "MISSES"

            lines.append(
                f"\nGoal (about 1/world of the weights plus one unit, {formula / mib:.0f} MiB), serving: "
                f"{verdict(beyond)} it with {_label(*best)[len('zero ZeRO-3 engine, ') :]}, {beyond / mib:.0f} MiB "
                f"beyond the dense forward's allocations. Whole run (peak per rank: the larger of the build's peak "
                f"growth, {build / mib:.0f} MiB, and serving's beyond those allocations, {beyond / mib:.0f} MiB): "
                f"{verdict(peak)} it, "
                f"{peak / mib:.0f} MiB ({peak / formula:.2f}x); the dense model's build alone grows "
                f"{most(dense, 'build_growth_bytes') / mib:.0f} MiB. " + CAUSE
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
