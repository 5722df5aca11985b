"""One tensor-parallelism benchmark run on one rank (launched by torchrun on 2 ranks): the main job's Llama trained
for a few steps under zero or DeepSpeed, either split by AutoTP over both ranks (``--mode tp``: tp=2 x dp=1, ZeRO-1
over the single data-parallel rank) or replicated and trained data-parallel (``--mode dp``: ZeRO-1 over dp=2).
Writes each step's time and loss, and the model-state bytes this rank holds, as JSON.

Both modes train on the same global batch of ``--global-batch`` rows per step (tp: every rank the whole batch; dp:
each rank its half), with train_worker.py's AdamW, clipping, data and seeded model, so the losses agree across
implementations and modes (the loss recorded is the global batch's mean in both).
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
from train_worker import BETAS, LR, WD, batches, build_model, optimizer_state_bytes, zero_like_config

TP = 2


def config(mode: str, micro: int, dp: int) -> dict:
    """DeepSpeed's keys, the same for both implementations: ZeRO-1 and, in tp mode, AutoTP with the Llama preset."""
    cfg = zero_like_config(1, micro, dp)
    if mode == "tp":
        cfg["tensor_parallel"] = {"autotp_size": TP, "preset_model": "llama"}
        # DeepSpeed checks train_batch_size against the whole world before it builds the tp groups: let both
        # implementations derive it from the micro-batch (zero: over the data-parallel ranks)
        del cfg["train_batch_size"]
    return cfg


def unique_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind ``tensors`` not yet in ``seen`` (each storage counted once)."""
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def deepspeed_state_bytes(engine, grads: int) -> dict[str, int]:
    """What DeepSpeed's ZeRO-1/2 engine holds on this rank: the module's parameters, its fp32 master partitions
    (kept even when training in fp32), the inner optimizer's state, and ``grads`` (measured after backward)."""
    seen: set = set()
    out = {"params": unique_bytes(engine.module.parameters(), seen), "grads": grads}
    out["master"] = unique_bytes(getattr(engine.optimizer, "single_partition_of_fp32_groups", []), seen)
    out["optimizer"] = optimizer_state_bytes("deepspeed", engine)
    out["total"] = sum(out.values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["zero", "deepspeed"])
    ap.add_argument("--mode", required=True, choices=["tp", "dp"])
    ap.add_argument("--stage", type=int, default=1, help="accepted for the launcher; both modes run ZeRO-1")
    ap.add_argument("--size", default="6m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    engine_mod = __import__(args.impl)
    if args.impl == "deepspeed":
        engine_mod.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = 1 if args.mode == "tp" else world
    micro = args.global_batch // dp
    data = batches(args.steps, micro, args.seq, 0 if dp == 1 else rank, dp)
    model = build_model(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    full_numel = {name: p.numel() for name, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    t0 = time.perf_counter()
    engine, *_ = engine_mod.initialize(model=model, optimizer=opt, config=config(args.mode, micro, dp))
    initialize_s = time.perf_counter() - t0
    local_params = sum(p.numel() for p in engine.module.parameters())
    # a parameter AutoTP split holds fewer elements than the model built it with
    replicated = sum(p.numel() for n, p in engine.module.named_parameters() if p.numel() == full_numel.get(n))

    losses, times, grads_held = [], [], 0
    for i, ids in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if i == len(data) - 1 and args.impl == "deepspeed":  # untimed work only in the last step's figures
            held = [p.grad for p in engine.module.parameters()]
            held += [g for part in getattr(engine.optimizer, "averaged_gradients", {}).values() for g in part or []]
            grads_held = unique_bytes(held, set())
        engine.step()
        times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        if dp > 1:  # the global batch's mean loss, as the tp ranks compute it
            dist.all_reduce(mean)
            mean /= dp
        losses.append(mean.item())
    if args.impl == "zero":
        state = engine.runtime.model_state_bytes()
    else:
        state = deepspeed_state_bytes(engine, grads_held)
    result = dict(impl=args.impl, mode=args.mode, size=args.size, rank=rank, world=world, params=n_params,
                  local_params=local_params, split_params=n_params - replicated, replicated_params=replicated,
                  initialize_s=initialize_s, step_s=times, losses=losses, model_state_bytes=state,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
