"""Pipeline parallelism on 2 and 4 gloo ranks (one stage per rank; pipe_worker.py): the main job's Llama cut by
the Hugging Face split, ZeRO-1, AdamW, fp32, ``--gas`` micro-batches per step. For zero's 1F1B, interleaved 1F1B
(2 virtual stages per rank) and zero-bubble (ZB-H1) schedules and DeepSpeed 0.19.8's PipelineEngine (1F1B) on the
same model, micro-batches and stages, and (named only, not by default) zero's eager 1F1B (``zero:eager_1f1b``) and
runs after each engine's ``engine.compile()`` (``IMPL:1f1b-compiled``, ``zero:eager_1f1b-compiled``; inductor,
their first 2 steps, compiling, dropped), in interleaved rounds (every second round reversed): the median step
time, the measured bubble fraction (``1 - compute / wall`` per stage, averaged over the stages) against the
schedule's theory, peak RSS per stage, the first step's loss, and the load average (``os.getloadavg()[0]``) at the
end of each launch.

Usage: python benchmarks/bench_pipeline.py [--quick] [--rounds N] [--size SIZE] [--ranks 2,4] [--bf16]
[--configs IMPL:SCHEDULE,...] (e.g. ``zero:1f1b,zero:zero_bubble``: those rows only)
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
ORDER = [("deepspeed", "1f1b"), ("zero", "1f1b"), ("zero", "interleaved"), ("zero", "zero_bubble")]
NAMES = {("deepspeed", "1f1b"): "DeepSpeed 1F1B", ("zero", "1f1b"): "zero 1F1B",
         ("zero", "interleaved"): "zero interleaved 1F1B (v=2)", ("zero", "zero_bubble"): "zero ZB-H1",
         ("deepspeed", "1f1b-compiled"): "DeepSpeed 1F1B, engine.compile()",
         ("zero", "1f1b-compiled"): "zero 1F1B, engine.compile()",
         ("zero", "eager_1f1b"): "zero eager 1F1B (2(p-s-1) warm-up forwards)",
         ("zero", "eager_1f1b-compiled"): "zero eager 1F1B, engine.compile()"}  # fmt: skip


def warmup(schedule: str) -> int:
    """Steps dropped per launch: 2 for a compiled run (compiling runs in the first), else 1."""
    return 2 if schedule.endswith("-compiled") else 1


def theory(schedule: str, p: int, m: int) -> str:
    """The schedule's bubble fraction with equal per-micro-batch costs: 1F1B ``(p-1)/(m+p-1)``; interleaved over
    ``v`` = 2 chunks ``(p-1)/(v*m+p-1)``; ZB-H1 ``(p-1)/(3m+p-1)`` when forward, input-gradient and
    weight-gradient passes cost the same (zero's weight pass computes the Linear weights' gradients only)."""
    schedule = schedule.removesuffix("-compiled")
    if schedule in ("1f1b", "eager_1f1b"):
        return f"{(p - 1) / (m + p - 1):.3f}"
    if schedule == "interleaved":
        return f"{(p - 1) / (2 * m + p - 1):.3f}"
    return f"{(p - 1) / (3 * m + p - 1):.3f} (T_F = T_B = T_W)"


def launch(impl: str, schedule: str, ranks: int, args, workdir: Path, tag: str) -> list[dict] | str:
    out = workdir / f"{impl}-{schedule}-{ranks}-{tag}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), str(HERE / "pipe_worker.py"),
           "--impl", impl, "--schedule", schedule, "--size", args.size, "--seq", str(args.seq), "--micro",
           str(args.micro), "--gas", str(args.gas), "--steps", str(args.steps + warmup(schedule) - 1),
           "--out", str(out), *(["--bf16"] if args.bf16 else [])]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return f"exit {proc.returncode}: " + (lines[-1][:200] if lines else "failed")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="3 steps, one round unless --rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    ap.add_argument("--size", default="6m")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--bf16", action="store_true", help="both engines with the bf16 section on (fp32 master weights)")
    ap.add_argument("--configs", default=",".join(f"{i}:{s}" for i, s in ORDER), help="IMPL:SCHEDULE,... to run")
    args = ap.parse_args(argv)
    order = [tuple(c.split(":", 1)) for c in args.configs.split(",")]
    unknown = [c for c in order if c not in NAMES]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(f'{i}:{s}' for i, s in NAMES)}")
    args.steps = 3 if args.quick else 4
    args.rounds = args.rounds or (1 if args.quick else 2)
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-pipe-"))
    rows = ["| ranks (stages) | configuration | median s/step | vs DeepSpeed 1F1B | measured bubble | theory "
            "| peak RSS per stage MiB | first loss | load average (1 min) at each launch's end |",
            "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for ranks in (int(r) for r in args.ranks.split(",")):
        runs: dict = {key: [] for key in order}
        for rnd in range(args.rounds):
            for impl, schedule in order if rnd % 2 == 0 else order[::-1]:
                print(f"bench pipeline: {ranks} ranks, round {rnd + 1}, {impl} {schedule}", file=sys.stderr,
                      flush=True)  # fmt: skip
                runs[(impl, schedule)].append(launch(impl, schedule, ranks, args, workdir, str(rnd)))
        medians = {}
        for key in order:
            done = [r for r in runs[key] if isinstance(r, list)]
            if not done:
                rows.append(f"| {ranks} | {NAMES[key]} | failed: {runs[key][0]} | | | | | | |")
                continue
            warm = warmup(key[1])
            walls = [t for launch_ in done for t in launch_[0]["wall_s"][warm:]]
            medians[key] = statistics.median(walls)
            bubble = statistics.mean(statistics.median(1 - c / w for c, w in zip(r["compute_s"][warm:],
                                                                                  r["wall_s"][warm:]))
                                     for launch_ in done for r in launch_)  # fmt: skip
            rss = " / ".join(f"{max(launch_[s]['peak_rss_mib'] for launch_ in done):.0f}" for s in range(ranks))
            loads = ", ".join(f"{launch_[0]['loadavg']:.1f}" for launch_ in done)
            base = medians.get(("deepspeed", "1f1b"))
            ratio = f"{medians[key] / base:.2f}x" if base else "n/a"
            first = done[0][0]["loss"][0]
            rows.append(f"| {ranks} | {NAMES[key]} | {medians[key]:.3f} | {ratio} | {bubble:.3f} | "
                        f"{theory(key[1], ranks, args.gas)} | {rss} | {first:.4f} | {loads} |")  # fmt: skip
    cmd = " ".join(["python benchmarks/bench_pipeline.py", *(argv or sys.argv[1:])])
    head = (f"`{cmd}`: model `{args.size}` (the main job's Llama), seq {args.seq}, micro-batch {args.micro}, "
            f"{args.gas} micro-batches per step, {args.steps} timed steps per launch (after 1 dropped, 2 compiled), "
            f"{args.rounds} rounds; {'bf16 (fp32 master weights)' if args.bf16 else 'fp32'}; "
            "gloo on CPU, one thread per rank.\n\n")  # fmt: skip
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(main())
