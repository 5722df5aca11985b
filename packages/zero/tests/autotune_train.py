"""A user's training script for the autotuner's tests: a small MLP trained through zero.initialize.

``--deepspeed_config PATH`` is the config (each experiment hands its own); with a micro-batch above 1,
``--crash-stage S`` raises at ZeRO stage S and ``--hang-stage S`` sleeps forever at stage S, to stand for a crashed
or hung experiment.
"""

import argparse
import json
import time

import torch

import zero


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 97), torch.nn.GELU(), torch.nn.Linear(97, 7))


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(micro, 32, generator=g)
    return x, x[:, :7].sin()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--crash-stage", type=int, default=-1)
    parser.add_argument("--hang-stage", type=int, default=-1)
    args = parser.parse_args()
    with open(args.deepspeed_config) as f:
        cfg = json.load(f)
    stage = cfg.get("zero_optimization", {}).get("stage", 0)
    big = cfg.get("train_micro_batch_size_per_gpu", 1) > 1
    if stage == args.crash_stage and big:
        raise RuntimeError(f"simulated crash at stage {stage}")
    if stage == args.hang_stage and big:
        time.sleep(3600)
    engine, _, _, _ = zero.initialize(model=model(), config=args.deepspeed_config)
    micro, rank = engine.train_micro_batch_size_per_gpu(), engine.rank
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, rank)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    print(f"final loss {float(loss):.6f}", flush=True)


if __name__ == "__main__":
    main()
