"""One offload benchmark run on one rank (launched by torchrun): train the main job's Llama a few steps with zero
or DeepSpeed 0.19.8, with or without ``offload_optimizer``, and write per-step times as JSON.

Both implementations get the same config: the ``optimizer`` section (AdamW, the hyper-parameters of
train_worker.py; DeepSpeed then uses its DeepSpeedCPUAdam when offloading, zero its CPU Adam), no clipping,
``overlap_comm`` on, the same stage. ``--offload`` is ``none``, ``cpu`` or ``super`` (cpu + ``super_offload``),
``param`` (``offload_param`` cpu, stage 3) or ``both`` (``offload_param`` and ``offload_optimizer`` cpu).
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
from train_worker import BETAS, LR, WD, batches, build_model  # noqa: E402


def config(stage: int, offload: str, micro: int, world: int) -> dict:
    zo: dict = {"stage": stage, "overlap_comm": True}
    if offload in ("cpu", "super", "both"):
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if offload == "super":
            zo["offload_optimizer"]["super_offload"] = True
    if offload in ("param", "both"):
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": micro * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8, "weight_decay": WD}},
        "gradient_clipping": 0.0,
        "zero_optimization": zo,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["zero", "deepspeed"], required=True)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--offload", choices=["none", "cpu", "super", "param", "both"], default="none")
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=4)
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
    cfg = config(args.stage, args.offload, args.micro, world)
    engine, *_ = lib.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    data = batches(args.steps, args.micro, 128, rank, world)
    losses, total, opt = [], [], []
    for batch in data:
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
    res = dict(impl=args.impl, stage=args.stage, offload=args.offload, step_s=total, opt_s=opt, losses=losses,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
