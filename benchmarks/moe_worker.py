"""One rank of the MoE benchmark (bench_moe.py), launched by torchrun with gloo: a tiny Mixtral-style model (token
embedding, blocks of LayerNorm + Linear mixing + a top-2 MoE of SwiGLU experts, LM head) whose MoE blocks are
``deepspeed.moe.layer.MoE`` (zero's, or DeepSpeed 0.19.8's), trained a few steps with torch AdamW. Writes
``rank<r>.json``: step times, losses, all-to-all bytes this rank sent to other ranks per step, model-state bytes.

Modes: ``ep`` (the MoE layers' ``ep_size`` = ``--ep``, ZeRO-2) and ``leaf`` (zero only: ``ep_size`` 1, ZeRO-3
with each MoE layer a leaf module: every rank computes every expert).
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

VOCAB, HIDDEN, FFN, EXPERTS, LAYERS, MICRO, SEQ = 512, 128, 256, 8, 2, 4, 64


class SwiGLU(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = torch.nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = torch.nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


class Net(torch.nn.Module):
    def __init__(self, moe_cls, ep: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norms = torch.nn.ModuleList([torch.nn.LayerNorm(HIDDEN) for _ in range(LAYERS)])
        self.mix = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS)])
        self.moes = torch.nn.ModuleList([moe_cls(HIDDEN, SwiGLU(), num_experts=EXPERTS, ep_size=ep, k=2,
                                                 capacity_factor=1.0, min_capacity=4, drop_tokens=True,
                                                 use_rts=False) for _ in range(LAYERS)])  # fmt: skip
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h, aux = self.embed(ids), 0.0
        for norm, mix, moe in zip(self.norms, self.mix, self.moes):
            out, l_aux, _ = moe(torch.tanh(mix(norm(h))))
            h, aux = h + out, aux + l_aux
        logits = self.head(h)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + 0.01 * aux


class SentBytes:
    """Wraps an all-to-all function, counting the bytes its input sends to other ranks (equal splits)."""

    def __init__(self, fn, group_arg: int) -> None:
        self.fn, self.group_arg, self.bytes = fn, group_arg, 0

    def __call__(self, *args, **kwargs):
        group = kwargs.get("group", args[self.group_arg] if len(args) > self.group_arg else None)
        size = dist.get_world_size(group)
        src = args[1]
        self.bytes += src.numel() * src.element_size() * (size - 1) // size
        return self.fn(*args, **kwargs)


def unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and torch.is_tensor(t) and t.numel() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["zero", "deepspeed"])
    ap.add_argument("--mode", required=True, choices=["ep", "leaf"])
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        import deepspeed
        import deepspeed.comm
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

        deepspeed.init_distributed(dist_backend="gloo")
        counter = SentBytes(deepspeed.comm.all_to_all_single, 4)
        deepspeed.comm.all_to_all_single = counter
        engine_mod = deepspeed
    else:
        import zero
        import zero_parallel.moe.dispatch as zero_dispatch
        from zero_parallel.moe import MoE
        from zero_parallel.moe import split_params_into_different_moe_groups_for_optimizer as split

        dist.init_process_group("gloo")
        counter = SentBytes(zero_dispatch.all_to_all_v, 4)
        zero_dispatch.all_to_all_v = counter
        engine_mod = zero
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = args.ep if args.mode == "ep" else 1
    model = Net(MoE, ep)
    if args.mode == "leaf":
        from zero.leaf_modules import set_z3_leaf_modules

        set_z3_leaf_modules(model, [MoE])
    groups = split([{"params": list(model.parameters()), "name": "params"}])
    opt = torch.optim.AdamW(groups, lr=1e-3)
    stage = 3 if args.mode == "leaf" else 2
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, *_ = engine_mod.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(rank)
    losses, times, sent = [], [], []
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
        dist.barrier()
        before, start = counter.bytes, time.perf_counter()
        loss = engine(ids)
        engine.backward(loss)
        if args.impl == "deepspeed":
            grads = unique_bytes([p.grad for p in engine.module.parameters()]
                                 + [x for part in getattr(engine.optimizer, "averaged_gradients", {}).values()
                                    for x in part or []])  # fmt: skip
        engine.step()
        times.append(time.perf_counter() - start)
        sent.append(counter.bytes - before)
        losses.append(loss.item())
    if args.impl == "zero":
        state = engine.runtime.model_state_bytes()
    else:
        state = {"params": unique_bytes(engine.module.parameters()), "grads": grads,
                 "master": unique_bytes(getattr(engine.optimizer, "single_partition_of_fp32_groups", [])),
                 "optimizer": unique_bytes([v for s in engine.optimizer.optimizer.state.values()
                                            for v in s.values()])}  # fmt: skip
        state["total"] = sum(state.values())
    expert = sum(p.numel() for p in engine.module.parameters() if not getattr(p, "allreduce", True))
    shared = sum(p.numel() for p in engine.module.parameters() if getattr(p, "allreduce", True))
    result = dict(impl=args.impl, mode=args.mode, ep=ep, rank=rank, world=world, step_s=times, losses=losses,
                  sent_bytes=sent, model_state_bytes=state, local_expert_params=expert, shared_params=shared,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
