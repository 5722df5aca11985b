"""transformers' Trainer with Accelerate's DeepSpeed sequence parallelism on zero (see test_hf_sequence_parallel.py).

Usage: hf_trainer_sp_job.py OUT_DIR MODE, MODE ``sp`` (``TrainingArguments(parallelism_config=ParallelismConfig(
sp_backend="deepspeed", sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(...)))`` and ZeRO-3 from a DeepSpeed
config on 2 ranks: each rank its half of every sequence, sp x dp = 2 x 1), ``nosp`` (the same without a parallelism
config on 1 rank: the same sequences per step) or ``plain`` (no DeepSpeed, no sp, 1 process: what the test runs
in-process as the reference). use_cpu=True (no CUDA here), 4 optimizer steps, fp32. Rank 0 writes OUT_DIR/MODE.json:
the per-step losses, the wrapped model's class and the world size.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from hf_trainer_job import DS_CONFIG, Losses, Tokens, _teardown, model
from transformers import Trainer, TrainingArguments

SEQ = 16


class PositionedTokens(Tokens):
    """The Trainer's sequence parallelism needs each sample's ``position_ids`` (DeepSpeed's loader adapter shards
    them with the tokens, so every shard knows its global positions)."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "position_ids": torch.arange(SEQ)}


def train(out: str, mode: str) -> dict:
    """Train as ``mode`` says; returns what rank 0 writes."""
    extra = {}
    if mode == "sp":
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        handler = DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_seq_length_is_variable=False,
                                                  sp_attn_implementation="sdpa")  # fmt: skip
        extra["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler)
    args = TrainingArguments(
        **extra,
        output_dir=os.path.join(out, mode), per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=4, learning_rate=1e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
        ddp_backend=None if mode == "plain" else "gloo",
        disable_tqdm=True, lr_scheduler_type="linear", use_cpu=True, deepspeed=None if mode == "plain" else DS_CONFIG,
    )  # fmt: skip
    losses = Losses()
    net = model()
    net.config._attn_implementation = "sdpa"
    trainer = Trainer(model=net, args=args, train_dataset=PositionedTokens(), callbacks=[losses])
    trainer.train()
    wrapped = type(trainer.model_wrapped)
    return {"losses": losses.losses, "wrapped": f"{wrapped.__module__}.{wrapped.__name__}",
            "world": args.world_size, "rank": args.process_index}  # fmt: skip


def main(out: str, mode: str) -> None:
    result = train(out, mode)
    if result["rank"] == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    _teardown()
