"""Interleaved A/B of the compiled path on one rank (launched by torchrun): several modes, each with its own copy of
the main job's Llama and its own engine, in ONE process; after each mode's warm-up the rounds alternate the modes
step by step (the order reversed every other round), so load from other processes falls on every mode alike.
Prints, on rank 0, each mode's median step and its median per-round ratio to eager, to plain torch_compile and to
the faster of the two (the issue's targets), with the load average; ``--profile DIR`` also writes a torch profiler
table and trace of one more step of each mode.

Modes: ``eager``, ``torch_compile`` (inductor), ``deepcompile`` (zero_compile's passes, inductor), ``floor`` (plain
torch.compile forward + backward alone, no ZeRO, optimizer or collective: the compute every mode runs), and two
variants of deepcompile for A/B of a pass option: ``deepcompile_whole`` (stages 1/2: one reduce-scatter per bucket
after the last gradient, as before the pieces of ``passes/zero1.py``), ``deepcompile_d<N>`` (stage 3: prefetch
distance up to N units instead of 2) and ``deepcompile_nojoint`` (without inductor's joint-graph passes).

Usage: OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 benchmarks/compile_ab.py \
    --stage 1 --modes eager,torch_compile,deepcompile,floor --rounds 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_worker import Floor  # noqa: E402
from train_worker import batches, build_model  # noqa: E402


def build(mode: str, stage: int, size: str):
    """One engine (or the floor) for ``mode``; variants patch the pass option they vary while the engine builds."""
    import zero
    import zero_compile.compiled as zcc
    from zero_compile.passes.zero1 import make_zero1

    model = build_model(size)
    if mode == "floor":
        return Floor(model)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": stage, "overlap_comm": True},
           "compile": {"deepcompile": mode.startswith("deepcompile"), "backend": "inductor", "warmup_steps": 2},
           "torch_compile": {"enabled": mode == "torch_compile", "backend": "inductor"}}  # fmt: skip
    # deepcompile_whole: CompiledZero builds its ZeRO-1 pass from this name when the engine builds it
    zcc.make_zero1 = (lambda _bytes: make_zero1(None)) if mode == "deepcompile_whole" else make_zero1
    engine = zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    if mode == "deepcompile_nojoint":  # read when each phase's backend is built; the first is rebuilt here
        engine.runtime.reducer.path.compiled.joint_passes = False
        engine.runtime.reducer.path.compiled._install()
    if mode.startswith("deepcompile_d"):  # read when the plan is made, at the end of warm-up
        engine.runtime.reducer.path.compiled.prefetch_distance = int(mode[len("deepcompile_d") :])
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="eager,torch_compile,deepcompile,floor")
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--warm", type=int, default=4, help="steps per mode before the rounds (deepcompile: 3 compile)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--profile", default=None, help="folder for one profiled step per mode (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = 64  # several copies of one model class compile in one process
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = args.modes.split(",")
    engines = {m: build(m, args.stage, args.size) for m in modes}
    data = batches(args.warm + args.rounds + 1, 4, 128, rank, world)

    losses: dict[str, float] = {}

    def step(m: str, i: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        e = engines[m]
        loss = e(input_ids=data[i], labels=data[i]).loss
        e.backward(loss)
        e.step()
        losses[m] = float(loss.detach())
        return time.perf_counter() - t0

    for m in modes:
        for i in range(args.warm):
            step(m, i)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            times[m].append(step(m, args.warm + r))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        for m in modes:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                dt = step(m, args.warm + args.rounds)
            if rank == 0:
                table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
                (out / f"prof_{m}.txt").write_text(f"step {dt:.3f} s\n{table}")
                prof.export_chrome_trace(str(out / f"trace_{m}.json"))
    if rank == 0:
        print(report(times, args), flush=True)
        print("last losses (every ZeRO mode trains the same model on the same data):", losses, flush=True)
    for e in engines.values():
        e.destroy()
    dist.barrier()
    dist.destroy_process_group()


def report(times: dict[str, list[float]], args) -> str:
    """Median step per mode and median per-round ratios to the baselines present."""
    base = [b for b in ("eager", "torch_compile") if b in times]
    lines = [f"stage {args.stage}, {args.size}, {args.rounds} interleaved rounds; load average {os.getloadavg()}"]
    for m, t in times.items():
        line = f"{m:20s} median {statistics.median(t):.3f} s"
        for b in base:
            line += f"  /{b} {statistics.median(a / c for a, c in zip(t, times[b])):.3f}"
        if base:
            best = [min(times[b][i] for b in base) for i in range(len(t))]
            line += f"  /faster baseline {statistics.median(a / c for a, c in zip(t, best)):.3f}"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
