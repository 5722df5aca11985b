"""transformers' Trainer with a DeepSpeed config on a machine without CUDA, 2 ranks (see test_hf_cpu_trainer.py).

Usage: hf_trainer_cpu_job.py OUT_DIR MODES, MODES one or more of these, comma-separated and run in one launch
(hf_trainer_job.run_modes): ``plain`` (TrainingArguments(deepspeed=...) only: the Trainer counts one process),
``use_cpu`` (the same with ``use_cpu=True``), ``ddp`` (``use_cpu=True``, no DeepSpeed).
ZeRO-2, 4 optimizer steps. Rank 0 writes OUT_DIR/MODE.json: the per-step losses, whether the Trainer ran
DeepSpeed and the class of the wrapped model.
"""

from __future__ import annotations

import json
import os
import sys

from hf_trainer_job import DS_CONFIG_ZERO2, Losses, Tokens, _teardown, model
from job_modes import run_modes
from transformers import Trainer, TrainingArguments


def main(out: str, mode: str) -> None:
    args = TrainingArguments(
        output_dir=os.path.join(out, mode), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=1e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, ddp_backend="gloo",
        disable_tqdm=True, lr_scheduler_type="linear", use_cpu=mode != "plain",
        deepspeed=None if mode == "ddp" else DS_CONFIG_ZERO2,
    )  # fmt: skip
    losses = Losses()
    trainer = Trainer(model=model(), args=args, train_dataset=Tokens(), callbacks=[losses])
    trainer.train()
    wrapped = type(trainer.model_wrapped)
    result = {"losses": losses.losses, "deepspeed": trainer.is_deepspeed_enabled,
              "wrapped": f"{wrapped.__module__}.{wrapped.__name__}", "world": args.world_size}  # fmt: skip
    if args.process_index == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    run_modes(main, sys.argv[1], sys.argv[2])
    _teardown()
