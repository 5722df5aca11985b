"""The pre-trained starting point of bench_zenflow's fine-tuning table: the main job's Llama trained in one process
with plain ``torch.optim.AdamW`` (train_worker's lr, betas and weight decay, clipping at 1.0) on the first
``steps`` global batches of train_worker's text, cached so that later runs load it.

Usage: python benchmarks/zenflow_pretrain.py --size 6m --steps 600 [--rows 4 --seq 64 --threads 1]

One thread by default: on a busy 2-core machine two OpenMP threads spin against each other (several times slower).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train_worker import BETAS, CLIP, LR, WD, batches, build_model  # noqa: E402

CACHE = HERE.parent / "runs" / "bench-cache"  # runs/ is the repository's ignored work folder


def cache_path(size: str, steps: int, rows: int, seq: int) -> Path:
    """Where the state dict of ``size`` after ``steps`` steps of ``rows`` x ``seq`` tokens is cached (``.pt``;
    its loss curve beside it, ``.json``)."""
    return CACHE / f"zenflow-pretrained-{size}-{steps}steps-{rows}x{seq}.pt"


def pretrained(size: str, steps: int, rows: int, seq: int, threads: int = 1) -> tuple[Path, list[float]]:
    """The cached state dict's path and the pre-training losses (one per step); trained first if not cached.

    ``rows`` is the global batch (micro-batch x ranks of the run it starts), so step ``i`` here sees exactly the
    rows the ranks of a 2-rank run would see at step ``i`` of ``train_worker.batches``."""
    path = cache_path(size, steps, rows, seq)
    curve = path.with_suffix(".json")
    if path.exists() and curve.exists():
        return path, json.loads(curve.read_text())["losses"]
    torch.set_num_threads(threads)
    model = build_model(size)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    losses = []
    t0 = time.perf_counter()
    for i, batch in enumerate(batches(steps, rows, seq, 0, 1)):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (i + 1) % 25 == 0:
            print(f"pretrain {size}: step {i + 1}/{steps} loss (last 25) {statistics.fmean(losses[-25:]):.4f} "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    curve.write_text(json.dumps({"losses": losses, "seconds": time.perf_counter() - t0}))
    return path, losses


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6m")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    print(pretrained(a.size, a.steps, a.rows, a.seq, a.threads)[0])
