"""GPU check of zero-compile (run by gpu/run.py): the ZeRO-3 row of the compile bench on CUDA (compiled ZeRO-3 vs
ZeRO-3 eager), driven through the engine of the meta-package `zero`.

Run on a machine with a CUDA GPU and a CUDA build of torch, from the repository root:

    python gpu/compiled_zero3.py [--size 20m] [--steps 8]   # exit 0 when losses agree

One process, NCCL, world size 1 (the graphs' gathers and reduce-scatters still run through zero_comm). Trains the
main job's Llama with zero's engine at stage 3, eager and then ``compile.deepcompile`` (inductor), on the same
batches; prints the first-step (compile) time, the median step time after warm-up of each, their ratio, and the
largest relative loss difference (fp32; 1e-4 allowed: inductor's fused kernels round differently from eager).
Without CUDA it prints "no CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _train(mode: str, size: str, steps: int) -> tuple[list[float], list[float]]:
    import torch

    import zero

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_worker import batches, build_model

    torch._dynamo.reset()
    model = build_model(size).cuda()
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
           "compile": {"deepcompile": mode == "deepcompile", "backend": "inductor", "warmup_steps": 2}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    times, losses = [], []
    for ids in batches(steps, 4, 128, 0, 1):
        ids = ids.cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    engine.destroy()
    return times, losses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("no CUDA: nothing to check")
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    eager_t, eager_l = _train("eager", args.size, args.steps)
    comp_t, comp_l = _train("deepcompile", args.size, args.steps)
    e, c = statistics.median(eager_t[3:]), statistics.median(comp_t[3:])
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(comp_l, eager_l))
    print(f"{torch.cuda.get_device_name()} Llama {args.size}, stage 3, 1 rank")
    print(f"eager: first step {eager_t[0]:.2f} s, median {e * 1e3:.1f} ms")
    print(f"deepcompile (inductor): first step {comp_t[0]:.2f} s, median {c * 1e3:.1f} ms, ratio {c / e:.2f}x")
    print(f"largest relative loss difference: {worst:.2e}")
    dist.destroy_process_group()
    return 0 if worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
