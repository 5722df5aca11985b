"""Training step time side by side: zero stages 0-3 vs DeepSpeed stages 1-3 vs FSDP2 vs DDP, and the compute floor.

Every configuration is launched with torchrun on 2 gloo ranks, 1 thread each, and trains the same Llama model on the
same byte-level batches with the same AdamW (see train_worker.py). Peers and ours alternate so that drift of this
shared machine hits both, and the whole sequence runs ``--rounds`` times, every second round in reverse order
(ABBA: a linear drift of the machine's load over the run hits a configuration and its peer alike). Reports the
median over every round's steps (each launch's first step, which warms caches, is dropped).

Usage: python benchmarks/bench_training.py [--quick] [--rounds N] [--out DIR] [--size 20m] [--config zero3 ...]
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
# (impl, stage, peer it is compared with); ours follow their peer so drift is shared.
ORDER = [
    ("local", 0, None), ("ddp", 0, None), ("zero", 0, ("ddp", 0)),
    ("deepspeed", 1, None), ("zero", 1, ("deepspeed", 1)),
    ("deepspeed", 2, None), ("zero", 2, ("deepspeed", 2)),
    ("deepspeed", 3, None), ("fsdp2", 0, None), ("zero", 3, ("deepspeed", 3)),
    ("zero-gather", 3, ("deepspeed", 3)),
]  # fmt: skip
# "local": the compute floor, each rank training its own copy of the model with no collective (the same model,
# batches and AdamW; its losses are one rank's own, not the global batch's): what a step costs this machine before
# any communication, so that "vs floor" says how much each implementation adds to it.
# "zero-gather": zero stage 3 with stage3_shared_shards off, every unit all-gathered over gloo (the "zero" row
# copies units from the peers' shards in shared memory, the default of the main job).


def run_one(
    impl: str,
    stage: int,
    size: str,
    steps: int,
    workdir: Path,
    worker_args: tuple[str, ...] = (),
    worker: str = "train_worker.py",
) -> dict | str:
    """Launch one configuration of ``worker`` (``worker_args`` appended to its command line); return rank 0's
    result dict (``peak_rss_bytes_max``: the largest of both ranks), or the error text."""
    out = workdir / f"{impl}{stage}-{size}{'-'.join(('', *worker_args)).replace('--', '')}"
    worker_impl, extra = ("zero", ["--shared-shards", "false"]) if impl == "zero-gather" else (impl, [])
    extra += list(worker_args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(HERE / worker),
           "--impl", worker_impl, "--stage", str(stage), "--size", size, "--steps", str(steps), "--out", str(out),
           *extra]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)
        lines = proc.stderr.strip().splitlines()
        lines = [ln for ln in lines if ln.startswith("[rank") and "Error:" in ln] or lines  # a rank's own error
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "failed")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    res = ranks[0]
    res["peak_rss_bytes_max"] = max(r["peak_rss_bytes"] for r in ranks)
    res["peak_rss_split_bytes_max"] = max(split_shared(r) for r in ranks)
    return res


def split_shared(rank_result: dict) -> float:
    """A rank's peak RSS with its shared-memory pages counted once across the ranks that map them (each rank's
    RSS counts them in full): peak - shmem x (world - 1) / world. Exact when the shared pages are resident at the
    peak, as stage 3's windows are from the first forward on (a page read once stays mapped)."""
    shm = rank_result.get("rss_shmem_bytes") or 0  # workers that do not report it: none counted
    if not shm:
        return rank_result["peak_rss_bytes"]
    return rank_result["peak_rss_bytes"] - shm * (rank_result["world"] - 1) / rank_result["world"]


def median_step(res: dict) -> float:
    """Median step time over every round's launch of this configuration (each launch's first step dropped)."""
    rounds = res.get("rounds") or [res["step_s"]]
    return statistics.median([t for r in rounds for t in (r[1:] if len(r) > 1 else r)])


def merge_round(results: dict, key: tuple, res: dict | str) -> None:
    """Add one launch's result to ``results[key]``: step times pooled by round, peak RSS the largest seen; the
    first launch's losses, calls and bytes stand (every launch trains the same batches). A failed launch wins."""
    held = results.get(key)
    if held is None or isinstance(res, str):
        results[key] = res if isinstance(res, str) else dict(res, rounds=[res["step_s"]])
    elif isinstance(held, dict):
        held["rounds"].append(res["step_s"])
        held["peak_rss_bytes_max"] = max(held["peak_rss_bytes_max"], res["peak_rss_bytes_max"])
        held["peak_rss_split_bytes_max"] = max(held["peak_rss_split_bytes_max"], res["peak_rss_split_bytes_max"])


def zero_formula_bytes(stage: int, psi: int, n: int, persistent: int = 0) -> float:
    """ZeRO paper (arXiv 1910.02054, section 5) model-state bytes per rank for fp32 training with Adam, where the
    fp32 parameters double as master weights (no separate copy): params 4, grads 4, Adam moments 8 bytes/element,
    divided by N for what the stage shards (1: moments; 2: + grads; 3: + params). At stage 3, ``persistent``
    elements (at or below the persistence threshold) also stay whole on every rank: +4 bytes each. Padding is not
    included."""
    p, g, k = 4 * psi, 4 * psi, 8 * psi
    if stage == 0:
        return p + g + k
    if stage == 1:
        return p + g + k / n
    if stage == 2:
        return p + (g + k) / n
    return (p + g + k) / n + 4 * persistent


def table(results: dict, size: str) -> str:
    rows = ["| config | median s/step | vs floor | ratio vs peer | initialize() s (start-up s) | peak RSS/rank MiB "
            "| model-state MiB/rank (vs formula) | ring bytes/step vs theory | gloo wire bytes/step | calls/step "
            "| first losses |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for impl, stage, peer in ORDER:
        if not any(k[:2] == (impl, stage) for k in results):
            continue  # not run (--config)
        res = results.get((impl, stage, size))
        name = f"{impl} stage {stage}" if impl in ("zero", "deepspeed") else impl
        name = "zero stage 3, all-gather" if impl == "zero-gather" else name
        name = "no communication (compute floor)" if impl == "local" else name
        if not isinstance(res, dict):
            rows.append(f"| {name} | failed: {res} | | | | | |")
            continue
        floor = results.get(("local", 0, size))
        above = f"{median_step(res) / median_step(floor):.2f}x" if isinstance(floor, dict) else ""
        ratio = ""
        peers = [peer] + ([("fsdp2", 0)] if impl.startswith("zero") and stage == 3 else []) if peer else []
        if impl == "zero" and stage in (1, 2):
            peers.append(("ddp", 0))  # stages 1/2 do DDP's work plus sharding: DDP is the speed to match
        for p in peers:
            pres = results.get((*p, size))
            if isinstance(pres, dict):
                label = p[0] if p[0] != "deepspeed" else f"DS{p[1]}"
                ratio += f"{median_step(res) / median_step(pres):.2f}x {label} "
        losses = ", ".join(f"{x:.4f}" for x in res["losses"][:3])
        calls = res.get("collective_calls_last_step") or ""
        state = comm = wire = ""
        if impl.startswith("zero"):
            psi, n = res["params"], res["world"]
            formula = zero_formula_bytes(stage, psi, n, res["persistent_params"])
            got = res["model_state_bytes"]["total"]
            state = f"{got / 2**20:.1f} ({got / formula:.4f}x)"
            theory = (3 if stage == 3 else 2) * (n - 1) / n * psi * 4
            comm = f"{res['ring_bytes_last_step'] / theory:.4f}x"
            wire = f"{res['wire_bytes_last_step'] / 2**20:.1f} MiB"
        rss = f"{res['peak_rss_bytes_max'] / 2**20:.0f}"
        if res["peak_rss_split_bytes_max"] < res["peak_rss_bytes_max"]:  # shared pages: also counted once
            rss += f" ({res['peak_rss_split_bytes_max'] / 2**20:.0f} shared split)"
        rows.append(
            f"| {name} | {median_step(res):.3f} | {above} | {ratio.strip()} | "
            f"{res['initialize_s']:.3f} ({res['init_s']:.1f}) | {rss} | {state} | {comm} | {wire} | {calls} | "
            f"{losses} |"
        )
    return "\n".join(rows)


def loss_agreement(results: dict, size: str, tol: float = 1e-3) -> str:
    """Same math check: the first step's loss (before any update differs) and the next ones, zero vs peers."""
    ref = results.get(("ddp", 0, size))
    if not isinstance(ref, dict):
        return "no DDP reference"
    lines = []
    for key, res in results.items():
        if key[2] != size or not isinstance(res, dict) or key[:2] in (("ddp", 0), ("local", 0)):
            continue
        diffs = [abs(a - b) for a, b in zip(res["losses"], ref["losses"])]
        ok = all(d <= tol * max(1.0, abs(b)) for d, b in zip(diffs, ref["losses"]))
        lines.append(f"{key[0]} {key[1]}: max |loss - ddp| = {max(diffs):.2e} {'ok' if ok else 'DIFFERS'}")
    return "; ".join(lines)


def ratio_chart(results: dict, sizes: list[str], out_png: Path) -> None:
    """Bar chart of zero's step-time ratio to each peer (below 1.0 is faster), one group of bars per model size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [(("zero", 0), ("ddp", 0)), (("zero", 1), ("ddp", 0)), (("zero", 2), ("ddp", 0)),
             (("zero", 1), ("deepspeed", 1)), (("zero", 2), ("deepspeed", 2)),
             (("zero", 3), ("deepspeed", 3)), (("zero", 3), ("fsdp2", 0))]  # fmt: skip
    labels = ["zero0/DDP", "zero1/DDP", "zero2/DDP", "zero1/DS1", "zero2/DS2", "zero3/DS3", "zero3/FSDP2"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        vals = []
        for ours, peer in pairs:
            a, b = results.get((*ours, size)), results.get((*peer, size))
            ok = isinstance(a, dict) and isinstance(b, dict)
            vals.append(median_step(a) / median_step(b) if ok else float("nan"))
        ax.bar([x + i * width for x in range(len(pairs))], vals, width, label=f"Llama {size}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(sizes) - 1) / 2 for x in range(len(pairs))], labels)
    ax.set_ylabel("median step time ratio (lower is better)")
    ax.set_title("zero vs peers, same run, 2 gloo ranks x 1 thread, fp32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return markdown (also written to OUT/training.md with raw JSON beside it)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one model size, fewer steps (under ~10 minutes)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--chart", default=str(HERE.parent / "docs" / "benchmarks_ratios.png"), help="PNG of the ratios")
    ap.add_argument("--rounds", type=int, default=2, help="times the whole sequence runs (alternately reversed)")
    ap.add_argument("--size", action="append", choices=["6m", "20m"], help="model size (repeatable; default both)")
    configs = [f"{i}{s}" for i, s, _ in ORDER]
    ap.add_argument("--config", action="append", choices=configs, help="only these, IMPL+STAGE (repeatable; no chart)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    # 20m is the main job's default model; 6m the second size.
    sizes = args.size or (["20m"] if args.quick else ["6m", "20m"])
    order = [row for row in ORDER if not args.config or f"{row[0]}{row[1]}" in args.config]
    steps = 5 if args.quick else 8
    workdir = Path(args.out or tempfile.mkdtemp(prefix="zero-bench-"))
    results: dict = {}
    for rnd in range(args.rounds):
        for size in sizes:
            for impl, stage, _ in order if rnd % 2 == 0 else order[::-1]:
                print(f"bench: round {rnd + 1} {impl} stage {stage} size {size}", file=sys.stderr, flush=True)
                merge_round(results, (impl, stage, size), run_one(impl, stage, size, steps, workdir))
    md = []
    for size in sizes:
        params = next((r["params"] for k, r in results.items() if k[2] == size and isinstance(r, dict)), "?")
        md.append(f"### Llama {size} ({params} params), 2 gloo ranks x 1 thread, micro-batch 4 x 128, fp32, AdamW")
        md.append(
            f"\nMedian over {args.rounds} round(s) of {steps} steps per configuration (each launch's first "
            "step dropped; every second round in reverse order).\n"
        )
        md.append(table(results, size))
        md.append(
            "\nPeak RSS/rank: the larger rank's `ru_maxrss`, which counts shared-memory pages in full in every rank "
            "mapping them (zero stage 3's shared windows: its own shard and the peer's it reads); in parentheses, "
            "those pages counted once across the ranks (peak - RssShmem x (ranks - 1) / ranks)."
        )
        md.append(f"\nLoss agreement (first {steps} steps): {loss_agreement(results, size)}\n")
    (workdir / "results.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}))
    if not args.config:  # a subset lacks most pairs: it must not overwrite the full run's chart
        chart = Path(args.chart)
        ratio_chart(results, sizes, chart)
        md.append(f"![step-time ratios]({chart.name})\n")
    text = "\n".join(md)
    (workdir / "training.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main())
