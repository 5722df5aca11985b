"""Decoding on the CPU: the main job's Llama (``zero train``'s default size, fp32, gloo) generating greedily.

Configurations, each launched by torchrun (decode_worker.py): transformers' ``generate`` in one process; zero's
``init_inference`` AutoTP tp=2; zero's fused blocks (``replace_with_kernel_inject``) at tp=1 and tp=2, and at tp=1
with the decode step compiled (``engine.compile()``), in fp32 and in bf16 (against transformers in the same dtype);
AutoTP tp=2 and the fused blocks at tp=1 and tp=2 with the model built on the meta device and read from a
safetensors checkpoint folder (written once per run), each rank reading its shards; the ceiling of the decode step's
weight products (the fused blocks' weights in a bare Python loop of ``F.linear``, no other work); DeepSpeed 0.19.8's
``init_inference`` AutoTP tp=2 (capped at ``--cap`` seconds: a run past it has its stacks dumped by faulthandler and
is reported with where it stood); and the hybrid engine's rollout against GatheredParameters + transformers'
generate (ZeRO-3, 2 ranks). Interleaved rounds (every second reversed), medians; the load average (``uptime``) is
written beside every figure, since the machine is shared. Each configuration's greedy tokens are compared with
transformers' in the same dtype.

Usage: python benchmarks/bench_decode.py [--quick] [--rounds N] [--size SIZE] [--cap S] [--only MODES]
       python benchmarks/bench_decode.py --ab [--dtype bf16] [--reps N]   (the in-process A/B of the fused blocks)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CKPT = "{checkpoint}"
"""Stands in a configuration's arguments for the run's checkpoint folder (written once by the worker's save mode)."""
# (label, mode, ranks, extra worker arguments)
CONFIGS = [
    ("transformers generate, 1 process", "hf", 1, ()),
    ("zero init_inference AutoTP tp=2", "autotp", 2, ()),
    ("zero fused blocks tp=1", "inject", 1, ()),
    ("zero fused blocks tp=2", "inject", 2, ()),
    ("zero fused blocks tp=1, decode step compiled", "inject", 1, ("--compile",)),
    ("zero AutoTP tp=2, from a checkpoint folder into the meta device", "autotp", 2, ("--checkpoint", CKPT)),
    ("zero fused blocks tp=1, from a checkpoint folder into the meta device", "inject", 1, ("--checkpoint", CKPT)),
    ("zero fused blocks tp=2, from a checkpoint folder into the meta device", "inject", 2, ("--checkpoint", CKPT)),
    ("matmul ceiling: a decode step's weight products only", "matmul", 1, ()),
    ("transformers generate, 1 process, bf16", "hf", 1, ("--dtype", "bf16")),
    ("zero fused blocks tp=1, decode step compiled, bf16", "inject", 1, ("--compile", "--dtype", "bf16")),
    ("matmul ceiling: a decode step's weight products only, bf16", "matmul", 1, ("--dtype", "bf16")),
    ("DeepSpeed 0.19.8 init_inference AutoTP tp=2, LOCAL_SIZE=2 (as its launcher)", "deepspeed", 2, ("--local-size",)),
    ("DeepSpeed 0.19.8 init_inference AutoTP tp=2, under torchrun", "deepspeed", 2, ()),
    ("DeepSpeed 0.19.8 init_inference AutoTP tp=2, shm all-reduce op off", "deepspeed", 2, ("--no-shm",)),
]


def load() -> str:
    """The 1-minute load average now (what ``uptime`` shows first)."""
    return f"{os.getloadavg()[0]:.2f}"


def launch(mode: str, ranks: int, extra: tuple, args, out: Path) -> dict | str:
    """Rank results of one run (a list under "ranks"), or the error text (with the stacks of a hang)."""
    worker = str(HERE / "decode_worker.py")
    extra = tuple(str(args.checkpoint) if e == CKPT else e for e in extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), worker, "--mode", mode,
           "--size", args.size, "--new", str(args.new), "--reps", str(args.reps),
           "--cap", str(args.cap), "--out", str(out), *extra]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.cap + 60)
    except subprocess.TimeoutExpired:
        return f"killed after {args.cap + 60:.0f} s"
    if proc.returncode != 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)
        stacks = [(out / f"stacks{r}.txt").read_text() for r in range(ranks) if (out / f"stacks{r}.txt").exists()]
        where = [s.strip().splitlines() for s in stacks if s.strip()]
        if where:
            frames = [ln.strip() for ln in where[0] if ln.strip().startswith("File")][:4]
            what = "crashed" if "Fatal Python error" in stacks[0] else f"hung past {args.cap:.0f} s"
            return f"{what} (after {time.time() - start:.0f} s in all); rank 0 stood at: " + " <- ".join(frames)
        lines = [ln for ln in proc.stderr.strip().splitlines() if "Error" in ln] or proc.stderr.strip().splitlines()
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "failed")
    return {"ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], "load": load()}


def in_process_ab(args, workdir: Path) -> str:
    """The worker's ``ab`` mode (one process, ``--reps`` interleaved rounds) as a markdown table: each variant's
    decode tokens/s, median and best round, against transformers' in the same dtype."""
    r = launch("ab", 1, ("--dtype", args.dtype), args, workdir / "ab")
    if isinstance(r, str):
        return f"in-process A/B failed: {r}\n"
    res = r["ranks"][0]
    ref = res["rates"]["transformers"]
    rows = [f"| variant ({args.dtype}) | median tokens/s | vs transformers | best round | vs transformers | tokens = "
            "transformers' |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, rates in res["rates"].items():
        med, best = statistics.median(rates), max(rates)
        same = res["same_tokens"].get(name, "" if name == "matmul ceiling" else True)
        rows.append(f"| {name} | {med:.1f} | {med / statistics.median(ref):.2f}x | {best:.1f} | "
                    f"{best / max(ref):.2f}x | {same} |")  # fmt: skip
    return (f"In one process, {args.reps} interleaved rounds, {args.new} new tokens, one thread; load {r['load']}."
            "\n\n" + "\n".join(rows) + "\n")  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    """Run every configuration; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one round, fewer tokens")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    ap.add_argument("--size", default="20m")
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 32, 16 with --quick)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cap", type=float, default=180.0, help="seconds a run may take before its stacks are dumped")
    ap.add_argument("--ab", action="store_true", help="only the in-process A/B of the fused-block variants")
    ap.add_argument("--dtype", default="fp32", help="--ab: fp32 or bf16")
    ap.add_argument("--only", default="", help="comma-separated modes to run (hf,autotp,inject,deepspeed,rollout)")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.new = args.new or (16 if args.quick else 32)
    only = set(filter(None, args.only.split(",")))
    configs = [c for c in CONFIGS if not only or c[1] in only]
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-decode-"))
    if args.ab:
        return in_process_ab(args, workdir)
    args.checkpoint = workdir / "checkpoint"
    if any(CKPT in c[3] for c in configs):
        saved = launch("save", 1, ("--checkpoint", CKPT), args, workdir / "save")
        if isinstance(saved, str):
            raise RuntimeError(f"bench decode: writing the checkpoint folder failed: {saved}")
    runs: dict = {c[0]: [] for c in configs}
    for rnd in range(args.rounds):
        for label, mode, ranks, extra in configs if rnd % 2 == 0 else configs[::-1]:
            print(f"bench decode: round {rnd + 1} {label} (load {load()})", file=sys.stderr, flush=True)
            tag = f"{mode}{ranks}{''.join(extra).replace('--', '-').replace(CKPT, '')}-r{rnd}"
            runs[label].append(launch(mode, ranks, extra, args, workdir / tag))
    rows = ["| configuration | ranks | time to first token s | decode tokens/s | vs transformers (same dtype) | "
            "tokens = transformers' | peak RSS/rank MiB | RSS gained by the model load MiB | load (1 min) |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    notes = []
    reference: dict = {}  # dtype -> (decode tokens/s, tokens) of transformers' generate
    for label, mode, _ranks, extra in configs:
        done = [r for r in runs[label] if isinstance(r, dict)]
        if mode == "hf" and done:
            dtype = "bf16" if "bf16" in extra else "fp32"
            reference[dtype] = (statistics.median(r["ranks"][0]["decode_tok_s"] for r in done), done[0]["ranks"][0])
    for label, mode, ranks, extra in configs:
        done = [r for r in runs[label] if isinstance(r, dict)]
        for r in runs[label]:
            if isinstance(r, str):
                notes.append(f"- {label}: {r}")
        if not done:
            rows.append(f"| {label} | {ranks} | did not finish | | | | | | {load()} |")
            continue
        ttft = statistics.median(r["ranks"][0]["ttft_s"] for r in done)
        tok = statistics.median(r["ranks"][0]["decode_tok_s"] for r in done)
        rss = max(x["peak_rss_bytes"] for r in done for x in r["ranks"]) / 2**20
        gained = max(x.get("load_rss_bytes", 0) for r in done for x in r["ranks"]) / 2**20
        ref = reference.get("bf16" if "bf16" in extra else "fp32")
        ratio = f"{tok / ref[0]:.2f}x" if ref else ""
        same = "" if mode in ("matmul", "deepspeed") or ref is None else str(
            all(x["tokens"] == ref[1]["tokens"] for r in done for x in r["ranks"]))  # fmt: skip
        loads = ", ".join(r["load"] for r in done)
        rows.append(f"| {label} | {ranks} | {ttft:.3f} | {tok:.1f} | {ratio} | {same} | {rss:.0f} | {gained:.0f} | "
                    f"{loads} |")  # fmt: skip
    text = (
        f"Llama {args.size} (`zero train`'s default is 20m), fp32 unless marked bf16, batch 1, a 32-byte prompt, "
        f"{args.new} new tokens greedy; {args.rounds} interleaved round(s) of {args.reps} timed calls each, medians; "
        "peak RSS the largest over the ranks (RSS gained by the model load: from before the model is built to "
        "init_inference's return); OMP_NUM_THREADS=1 per rank; load: the 1-minute load average after each run.\n\n"
        + "\n".join(rows) + "\n"
    )  # fmt: skip
    if not only or "rollout" in only:
        print(f"bench decode: rollout (load {load()})", file=sys.stderr, flush=True)
        r = launch("rollout", 2, (), args, workdir / "rollout")
        if isinstance(r, dict):
            h = statistics.median(x["hybrid_s"] for x in r["ranks"])
            g = statistics.median(x["gathered_s"] for x in r["ranks"])
            same = all(x["same_tokens"] for x in r["ranks"])
            text += ("\nHybrid engine rollout (ZeRO-3, 2 ranks, batch 1 per rank, the same prompt and tokens; median "
                     f"of {args.reps} interleaved pairs):\n\n| rollout | s | load |\n|---|---|---|\n"
                     f"| engine.generate (gathered copy, fused blocks) | {h:.3f} | {r['load']} |\n"
                     f"| GatheredParameters + transformers generate | {g:.3f} | {r['load']} |\n"
                     f"\nSame tokens: {same}.\n")  # fmt: skip
        else:
            notes.append(f"- rollout: {r}")
    if notes:
        text += "\n" + "\n".join(notes) + "\n"
    return text


if __name__ == "__main__":
    print(main(sys.argv[1:]))
