"""One NVMe-offload benchmark run on one rank (launched by torchrun): the main job's Llama, stage 3, optimizer state
on NVMe, with zero or DeepSpeed 0.19.8 and the same config (offload_worker.py's, with ``offload_optimizer`` on
nvme: ``buffer_count`` 12 (DeepSpeed fails with fewer: see BUFFER_COUNT), pipelined read and write,
``sub_group_size`` and the ``aio`` section below); writes per-step times, the optimizer step alone, losses and peak
RSS as JSON.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_worker import config  # noqa: E402
from train_worker import batches, build_model  # noqa: E402

AIO = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}  # fmt: skip
# DeepSpeed's pipelined swapper holds the sub-group being stepped (parameter and its two Adam moments), the
# next one being read and the previous one being written, each from its buffer pool: with 4 buffers its first
# step fails ("assert new_alloc_buffers is not None", pipelined_optimizer_swapper.py:219), with 8 a later swap-in
# does ("ran out of swap buffers", line 253); 12 runs. zero gets the same value (same config).
BUFFER_COUNT = 12


def nvme_config(micro: int, world: int, nvme_path: str, sub_group_size: int, buffer_count: int) -> dict:
    cfg = config(3, "none", micro, world)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path,
                                                     "buffer_count": buffer_count, "pipeline_read": True,
                                                     "pipeline_write": True}  # fmt: skip
    cfg["zero_optimization"]["sub_group_size"] = sub_group_size
    cfg["aio"] = dict(AIO)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["zero", "deepspeed"], required=True)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--sub-group-size", type=int, default=4_000_000)
    ap.add_argument("--buffer-count", type=int, default=BUFFER_COUNT)
    ap.add_argument("--nvme-path", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        import deepspeed as lib

        lib.init_distributed(dist_backend="gloo")
    else:
        import zero as lib

        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.size)
    cfg = nvme_config(args.micro, world, args.nvme_path, args.sub_group_size, args.buffer_count)
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, total, opt = [], [], []
    for batch in batches(args.steps, args.micro, 128, rank, world):
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        losses.append(loss.item())
        total.append(t2 - t0)
        opt.append(t2 - t1)
    res = dict(impl=args.impl, step_s=total, opt_s=opt, losses=losses,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
