"""The user's script that ``bench_autotune`` tunes: the main job's Llama (``zero train --model-size``) trained
through ``zero.initialize`` with the config given as ``--deepspeed_config`` (each experiment hands its own).

Batches are byte tokens of the stdlib's own source files, as in ``train_worker.py``.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

import zero
from zero.train.model import build_model


def tokens() -> torch.Tensor:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    text = b"".join(f.read_bytes() for f in files[:100])
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed_config", required=True)
    ap.add_argument("--size", default="6m")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(args.size, seq_len=args.seq, seed=1234)
    engine, _, _, _ = zero.initialize(model=model, config=args.deepspeed_config)
    data, micro = tokens(), engine.train_micro_batch_size_per_gpu()
    g = torch.Generator().manual_seed(engine.rank)
    for _ in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            starts = torch.randint(0, data.numel() - args.seq - 1, (micro,), generator=g).tolist()
            x = torch.stack([data[s : s + args.seq] for s in starts])
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()


if __name__ == "__main__":
    main()
