"""A training script written in DeepSpeed's documented style, run unchanged with ``import zero as deepspeed``.

    zero run --nproc-per-node 2 tests-integration/ds_style_train.py --stage 3 --save-dir /tmp/ckpt

initialize -> (forward, backward, step) per micro-batch -> save_checkpoint -> load_checkpoint into a fresh engine
-> continue. ``train(argv)`` returns the per-step global losses, the losses after resuming, and the final full
parameters, so tests can compare them with a single-process reference (tests-integration/test_deepspeed_style.py).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import zero as deepspeed

STEPS, RESUME_AT = 6, 3


class TinyNet(torch.nn.Module):
    """Linear(8,13) -> GELU -> Linear(13,7) -> GELU -> Linear(7,4): 247 parameters, no world size divides it."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.GELU(), torch.nn.Linear(13, 7),
                                       torch.nn.GELU(), torch.nn.Linear(7, 4))  # fmt: skip

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.net(x), y)


def dataset(n: int = 96) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.rand(n, 8, generator=g) * 2 - 1, torch.randint(0, 4, (n,), generator=g))


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        },  # fmt: skip
        "zero_optimization": {"stage": stage},
        "steps_per_print": 100,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed-style TinyNet training")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--save-dir", default=None, help="checkpoint root; without it no save/load round trip")
    parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    return parser.parse_args(argv)


def _global_mean(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def _run_steps(engine, loader_iter, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = next(loader_iter)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(_global_mean(total / engine.gradient_accumulation_steps()))
    return losses


def train(argv: list[str]) -> dict:
    args = parse(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234)
    model = TinyNet()
    config = ds_config(args.stage)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset(), config=config
    )
    it = iter(loader)
    losses = _run_steps(engine, it, RESUME_AT)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"seen": RESUME_AT})
    losses += _run_steps(engine, it, STEPS - RESUME_AT)
    out = {"losses": losses, "lr": engine.get_lr(), "global_steps": engine.global_steps,
           "params": {n: t.clone() for n, t in engine.runtime.full_parameters().items()}}  # fmt: skip
    if not args.save_dir:
        return out

    torch.manual_seed(999)  # a differently initialised model: everything must come from the checkpoint
    fresh = TinyNet()
    engine2, _, loader2, _ = deepspeed.initialize(args=args, model=fresh, training_data=dataset(),
                                                  config=ds_config(args.stage))  # fmt: skip
    _, client = engine2.load_checkpoint(args.save_dir)
    it2 = iter(loader2)
    for _ in range(RESUME_AT * engine2.gradient_accumulation_steps()):
        next(it2)  # skip the micro-batches already seen
    out["resumed"] = _run_steps(engine2, it2, STEPS - RESUME_AT)
    out.update(client=client, lr_resumed=engine2.get_lr(), global_steps_resumed=engine2.global_steps,
               params_resumed={n: t.clone() for n, t in engine2.runtime.full_parameters().items()})  # fmt: skip
    return out


if __name__ == "__main__":
    out = train(sys.argv[1:])
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("losses", " ".join(f"{v:.6f}" for v in out["losses"]))
        if "resumed" in out:
            print("resumed", " ".join(f"{v:.6f}" for v in out["resumed"]))
