"""One configuration's steady training step split into forward, backward and optimizer step (seconds, medians),
with the minor page faults per step: for comparing two builds of zero (or zero and a peer) launch by launch.

Launch: ``torchrun --nproc-per-node 2 benchmarks/step_phases.py --impl zero --stage 3 [--steps 9]`` with
``OMP_NUM_THREADS=1``; the same model, batches, AdamW and clipping as ``train_worker.py`` (its ``setup_phases``).
To compare two source trees, put each tree's ``packages/*/src`` first on ``PYTHONPATH`` and alternate launches
(ABBA). Rank 0 prints one line: the medians over every step but the first.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist
import train_worker as tw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="zero", choices=["zero", "deepspeed", "fsdp2", "ddp", "local"])
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = tw.build_model(args.size)
    data = tw.batches(args.steps, 4, 128, rank, world)
    forward, backward, step, _engine, _initialize_s = tw.setup_phases(args.impl, args.stage, model, 4, world)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "total": [], "faults": []}
    for i, batch in enumerate(data):
        dist.barrier()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        loss = forward(batch)
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        loss.item()
        if i:  # the first step warms caches (and records stage 3's order)
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                phases[key].append(value)
            phases["faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    if rank == 0:
        med = {k: statistics.median(v) for k, v in phases.items()}
        print(f"{args.impl} stage {args.stage}: " + ", ".join(
            f"{k} {v:.0f}" if k == "faults" else f"{k} {v:.3f} s" for k, v in med.items()))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
