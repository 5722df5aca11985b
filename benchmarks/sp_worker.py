"""One sequence-parallel benchmark launch on one rank (torchrun, 2 ranks): build the main job's Llama and its engine
under zero or DeepSpeed once, then run trials of ``--steps`` steps at each sequence length (``--seqs``, or a search
for the longest under ``--budget-mib``); write each trial's step times, losses and peak RSS as JSON.

Peak RSS of a trial: freed heap pages are returned (``malloc_trim``) and ``VmHWM`` is reset to the current RSS
(``/proc/self/clear_refs``) before it, read after it, and maxed over the ranks.

Recipes, the same code for both implementations (each through its own ``runtime.sequence_parallel.ulysses_sp`` and
``runtime.activation_checkpointing.offload_activations``); micro-batch 1 sequence:

* ``plain``: at ``--sp 1`` 2 data-parallel ranks, each its own sequence; at ``--sp 2`` Ulysses attention alone.
* ``alst`` (Arctic Long Sequence Training's recipe): Ulysses attention, every ``LlamaMLP`` through ``TiledMLP``, the
  loss through ``TiledFusedLogitsLoss`` on the head, transformers' non-reentrant gradient checkpointing of each
  decoder layer with the checkpointed hidden states offloaded to host memory.

The loss of a step is the whole sequence's mean: each rank's summed cross-entropy over its part, summed over the
sequence-parallel group by ``torch.distributed.nn.functional.all_reduce`` (whose backward sums the gradients over
the group, as the engines' average over sp x dp expects), over the counted positions.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import math
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from infer_worker import hwm_now, reset_hwm, rss_now
from train_worker import BETAS, LR, WD, batches, build_model, zero_like_config

IGNORE_INDEX = -100
LOSS_TILE = 4096  # positions per tile of TiledFusedLogitsLoss


def reset_peak_rss() -> int:
    """Return freed heap pages to the system (glibc ``malloc_trim``) and reset ``VmHWM`` to the current RSS (Linux
    ``clear_refs`` 5), so that the next peak read is of what runs after this call. Returns the RSS, bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset_hwm()
    return rss_now()


def patch_the_model(model, ulysses_sp, tiled: bool) -> None:
    """The causal LM's forward becomes ``forward(input_ids, position_ids, shift_labels) -> summed cross-entropy``
    (0-d). ``tiled`` (ALST's patches on the instances): each MLP through ``TiledMLP`` (tiles of ``hidden`` positions,
    DeepSpeed's example) and the loss through ``TiledFusedLogitsLoss`` (tiles of ``LOSS_TILE`` positions); otherwise
    the head's logits of the whole shard at once."""

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self, x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return ulysses_sp.TiledMLP.apply(mlp_forward, self, x, shards, params)

    if tiled:
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(tiled_mlp_forward, layer.mlp)

    def loss_fn(head, x, y):
        return F.cross_entropy(head(x).float().flatten(0, -2), y.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")  # fmt: skip

    def lm_forward(self, input_ids, position_ids, shift_labels):
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        if not tiled:
            return loss_fn(self.lm_head, hidden, shift_labels)
        shards = max(1, math.ceil(hidden.shape[0] * hidden.shape[1] / LOSS_TILE))
        params = list(self.lm_head.parameters())
        return ulysses_sp.TiledFusedLogitsLoss.apply(loss_fn, self.lm_head, hidden, shift_labels, None, shards,
                                                     params, "sum")  # fmt: skip

    model.forward = types.MethodType(lm_forward, model)


class Trial:
    """Trains ``steps`` steps at one sequence length on an engine built once; every rank of a sequence-parallel
    group feeds its part of the same sequences (``world / sp`` data-parallel rows per step)."""

    def __init__(self, engine, impl: str, recipe: str, sp: int, mpu, world: int, rank: int) -> None:
        self.engine, self.impl, self.recipe, self.sp, self.mpu = engine, impl, recipe, sp, mpu
        self.dp, self.dp_rank = world // sp, rank // sp
        self.group = None if mpu is None else mpu.get_sequence_parallel_group()
        self.sp_rank = 0 if mpu is None else mpu.get_sequence_parallel_rank()
        self.offload_mod = (importlib.import_module(f"{impl}.runtime.activation_checkpointing.offload_activations")
                            if recipe == "alst" else None)  # fmt: skip

    def step(self, x: torch.Tensor, offload) -> float:
        engine, seq = self.engine, x.shape[1]
        shift = torch.cat([x[:, 1:], torch.full((x.shape[0], 1), IGNORE_INDEX, dtype=x.dtype)], dim=1)
        counted = (shift != IGNORE_INDEX).sum()
        part = slice(self.sp_rank * seq // self.sp, (self.sp_rank + 1) * seq // self.sp)
        positions = torch.arange(seq).expand(x.shape[0], -1)[:, part].contiguous()
        with offload if offload is not None else contextlib.nullcontext():
            shard_sum = engine(input_ids=x[:, part].contiguous(), position_ids=positions,
                               shift_labels=shift[:, part].contiguous())  # fmt: skip
            if self.group is not None:
                shard_sum = torch.distributed.nn.functional.all_reduce(shard_sum, group=self.group)
            loss = shard_sum / counted
            engine.backward(loss)
        engine.step()
        return loss.item()

    def run(self, seq: int, steps: int) -> dict:
        """Train ``steps`` steps at ``seq``; returns times, losses and this rank's peak RSS of the trial (bytes,
        the largest over the ranks: every rank gets the same dict)."""
        data = batches(steps, 1, seq, self.dp_rank, self.dp)
        rss_before = reset_peak_rss()
        # A fresh offload context per trial: its buffer pool would keep the previous length's host buffers.
        offload = (self.offload_mod.get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=False,
                   use_streams=False) if self.offload_mod is not None else None)  # fmt: skip
        losses, times = [], []
        for x in data:
            dist.barrier()
            start = time.perf_counter()
            losses.append(self.step(x, offload))
            times.append(time.perf_counter() - start)
        peak = torch.tensor([hwm_now(), rss_before], dtype=torch.int64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return dict(seq=seq, step_s=times, losses=losses, peak_rss_bytes=int(peak[0]),
                    rss_before_bytes=int(peak[1]))  # fmt: skip


def search(trial: Trial, start: int, budget: int, steps: int, grain: int, longest: int) -> list[dict]:
    """Longest sequence whose trial peaks under ``budget`` bytes: double from ``start`` until one does not fit (or
    ``longest`` is passed), then bisect between the last fit and the first miss down to ``grain`` positions.
    Returns every trial in the order run (the decisions are the same on every rank: peaks are maxed over ranks)."""
    runs, fit, miss = [], None, None
    seq = start
    while miss is None and seq <= longest:
        runs.append(trial.run(seq, steps))
        if runs[-1]["peak_rss_bytes"] <= budget:
            fit, seq = seq, seq * 2
        else:
            miss = seq
    if fit is None or miss is None:
        return runs
    while miss - fit > grain:
        seq = (fit + miss) // 2 // grain * grain
        runs.append(trial.run(seq, steps))
        if runs[-1]["peak_rss_bytes"] <= budget:
            fit = seq
        else:
            miss = seq
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["zero", "deepspeed"])
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--size", default="6m")
    ap.add_argument("--sp", type=int, default=1, choices=[1, 2])
    ap.add_argument("--recipe", default="plain", choices=["plain", "alst"])
    ap.add_argument("--seqs", default="1024", help="comma-separated sequence lengths, one trial each")
    ap.add_argument("--steps", type=int, default=2, help="steps per trial")
    ap.add_argument("--budget-mib", type=float, default=0, help="search the longest length under this peak RSS")
    ap.add_argument("--grain", type=int, default=256, help="the search's resolution, positions")
    ap.add_argument("--longest", type=int, default=1 << 17, help="the search's longest length")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    engine_mod = __import__(args.impl)
    if args.impl == "deepspeed":
        engine_mod.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    cfg = zero_like_config(args.stage, 1, world // args.sp)
    ulysses_sp = importlib.import_module(f"{args.impl}.runtime.sequence_parallel.ulysses_sp")
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", args.sp, 1,
                                                                     seq_length_is_variable=True)  # fmt: skip
    if mpu is not None:
        cfg["sequence_parallel_size"] = args.sp
    patch_the_model(model, ulysses_sp, tiled=args.recipe == "alst")
    if args.recipe == "alst":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    t0 = time.perf_counter()
    engine, *_ = engine_mod.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    initialize_s = time.perf_counter() - t0
    trial = Trial(engine, args.impl, args.recipe, args.sp, mpu, world, rank)
    if args.budget_mib:
        seqs = [int(s) for s in args.seqs.split(",")]
        runs = search(trial, seqs[0], int(args.budget_mib * 2**20), args.steps, args.grain, args.longest)
    else:
        runs = [trial.run(int(s), args.steps) for s in args.seqs.split(",")]
    result = dict(impl=args.impl, sp=args.sp, recipe=args.recipe, size=args.size, stage=args.stage, params=n_params,
                  initialize_s=initialize_s, budget_mib=args.budget_mib, runs=runs,
                  peak_rss_bytes=max(r["peak_rss_bytes"] for r in runs))  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
