"""transformers' Trainer with the AutoTP guide's DeepSpeed config on zero (see test_hf_tensor_parallel.py).

Usage: hf_trainer_tp_job.py OUT_DIR MODES, comma-separated modes of ``tp`` (``"tensor_parallel": {"autotp_size": 2,
"preset_model": "llama"}`` beside ZeRO-1 in the config given to ``TrainingArguments(deepspeed=...)``, 2 ranks: one
tensor-parallel group, both ranks on the same samples), ``tp3`` (the same beside the ZeRO-3 config of
``hf_trainer_job``) or ``plain`` (no DeepSpeed, 1 process: what the test runs in-process as the reference).
use_cpu=True, 4 optimizer steps, fp32. In ``tp`` mode ``save_model`` then saves (an engine checkpoint, the config not
allowing a gather). Rank 0 writes OUT_DIR/MODE.json: the per-step losses, the wrapped model's class,
the world size and (``tp``) the largest relative difference between the model ``zero_to_fp32`` rebuilds from the
saved checkpoint and the engine's gathered weights (``_consolidated_16bit_state_dict``).
"""

from __future__ import annotations

import json
import os
import sys

from hf_trainer_job import DS_CONFIG, Losses, Tokens, _teardown, model
from transformers import Trainer, TrainingArguments

TP_CONFIG = {**DS_CONFIG, "zero_optimization": {"stage": 1},
             "tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}  # fmt: skip
TP3_CONFIG = {**DS_CONFIG, "tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}  # DS_CONFIG: ZeRO-3


def train(out: str, mode: str) -> dict:
    """Train as ``mode`` says; returns what rank 0 writes."""
    args = TrainingArguments(
        output_dir=os.path.join(out, mode), per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=4, learning_rate=1e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
        ddp_backend=None if mode == "plain" else "gloo",
        disable_tqdm=True, lr_scheduler_type="linear", use_cpu=True,
        deepspeed={"plain": None, "tp": TP_CONFIG, "tp3": TP3_CONFIG}[mode],
    )  # fmt: skip
    losses = Losses()
    trainer = Trainer(model=model(), args=args, train_dataset=Tokens(), callbacks=[losses])
    trainer.train()
    wrapped = type(trainer.model_wrapped)
    result = {"losses": losses.losses, "wrapped": f"{wrapped.__module__}.{wrapped.__name__}",
              "world": args.world_size, "rank": args.process_index}  # fmt: skip
    if mode == "tp":
        saved = os.path.join(out, "saved")
        # without stage3_gather_16bit_weights_on_model_save Accelerate refuses to gather and save_model saves an
        # engine checkpoint instead (DeepSpeed's behaviour): zero_to_fp32 gives the single-process model from it
        trainer.save_model(saved)
        full = trainer.model_wrapped._consolidated_16bit_state_dict()  # what Accelerate gathers when allowed
        if args.process_index == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            plain = model()
            plain.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(saved), strict=True)
            result["saved_worst"] = max(((p.detach() - full[n]).norm() / full[n].norm()).item()
                                        for n, p in plain.named_parameters())  # fmt: skip
    return result


def main(out: str, mode: str) -> None:
    result = train(out, mode)
    if result["rank"] == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    from job_modes import run_modes

    run_modes(main, sys.argv[1], sys.argv[2])
    _teardown()
