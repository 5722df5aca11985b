"""transformers' Trainer on zero, launched by ``zero run --as-deepspeed`` on 2 ranks (see test_hf_integration.py).

Usage: hf_trainer_job.py OUT_DIR MODES, MODES one or more of these, comma-separated and run in that order in one
launch (one process start-up for several runs; ``ddp`` first, see ``run_modes``): ``ddp`` (plain DDP), ``zero3``
(ZeRO-3, 20 steps, checkpoint at step 10, save_model with and without stage3_gather_16bit_weights_on_model_save),
``zero2`` (ZeRO-2, 20 steps), ``resume`` (ZeRO-3 from the step-10 checkpoint, the model built by from_pretrained
under ZeRO-3, gradient checkpointing on), ``eval`` (ZeRO-3, ``evaluate()`` with no training: transformers drops the
optimizer section and initializes a forward-only engine). Rank 0 writes OUT_DIR/MODE.json:
the per-step training losses (resume: also whether the model was partitioned at load and each loaded parameter's
sum; eval: the eval loss, whether the engine had no optimizer and held its parameters above the persistence
threshold, 10 x hidden, partitioned).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

STEPS, SAVE_AT = 20, 10


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=75, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class EvalTokens(Tokens):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return super().__getitem__(10_000 + i)


class Losses(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


# No scheduler section: the Trainer then builds its own linear-warmup scheduler and hands it to the engine, so the
# learning rates equal the DDP run's (DeepSpeed's WarmupDecayLR starts from the optimizer's lr, HF's from 0).
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
}  # fmt: skip


DS_CONFIG_ZERO2 = {**DS_CONFIG, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}


def main(out: str, mode: str) -> None:
    extra = {}
    if mode != "ddp":
        # On a machine without CUDA, Accelerate finds no backend for DeepSpeed and would run one process (with a
        # real DeepSpeed too): configure its state with gloo first and let the Trainer use it.
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        extra["accelerator_config"] = {"use_configured_state": True}
    args = TrainingArguments(
        **extra,
        output_dir=os.path.join(out, mode), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=1, save_steps=SAVE_AT, save_strategy="steps", report_to=[], seed=0, data_seed=0,
        dataloader_num_workers=0, use_cpu=mode == "ddp", ddp_backend="gloo", disable_tqdm=True,
        lr_scheduler_type="linear", deepspeed={"ddp": None, "zero2": DS_CONFIG_ZERO2}.get(mode, DS_CONFIG),
        save_only_model=False, per_device_eval_batch_size=2,
    )  # fmt: skip
    losses = Losses()
    if mode == "resume":
        # ZeRO-3 is configured (the TrainingArguments above): from_pretrained builds the model under zero.Init,
        # partitioned, and loads the saved weights into the shards (the checkpoint then overwrites them).
        import deepspeed  # served by zero

        net = LlamaForCausalLM.from_pretrained(os.path.join(out, "saved"))
        partitioned_at_load = all(p.numel() == 0 for p in net.parameters())
        with deepspeed.zero.GatheredParameters(list(net.parameters())):
            loaded_sums = {n: p.double().sum().item() for n, p in net.named_parameters()}
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        net = model()
    if mode == "eval":
        trainer = Trainer(model=net, args=args, eval_dataset=EvalTokens())
        metrics = trainer.evaluate()
        engine = trainer.model_wrapped
        result = {"eval_loss": metrics["eval_loss"], "optimizer": engine.optimizer is None,
                  "partitioned": all(p.numel() == 0 for p in net.parameters() if p.ds_numel > 10 * 32)}  # fmt: skip
        if args.process_index == 0:
            with open(os.path.join(out, f"{mode}.json"), "w") as f:
                json.dump(result, f)
        return
    trainer = Trainer(model=net, args=args, train_dataset=Tokens(), callbacks=[losses])
    if mode == "resume":
        trainer.train(resume_from_checkpoint=os.path.join(out, "zero3", f"checkpoint-{SAVE_AT}"))
    else:
        trainer.train()
    result = {"losses": losses.losses}
    if mode == "resume":
        result["partitioned_at_load"], result["loaded_sums"] = partitioned_at_load, loaded_sums
    if mode == "zero3":
        trainer.save_model(os.path.join(out, "saved"))  # consolidated weights; the test loads them
        # as a config with stage3_gather_16bit_weights_on_model_save false: the Trainer's fallback saves a
        # checkpoint (and its zero_to_fp32.py) instead of gathering the weights
        trainer.model_wrapped.config.zero_optimization.stage3_gather_16bit_weights_on_model_save = False
        trainer.save_model(os.path.join(out, "saved_without_gather"))
    if args.process_index == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)


def _teardown() -> None:
    """Ranks leave the process group together: a rank exiting while gloo still talks to it aborts with
    "terminate called without an active exception" (seen under load; ``zero train`` does the same)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from job_modes import run_modes  # here: the tests also load this file as a module, without jobs/ on sys.path

    run_modes(main, sys.argv[1], sys.argv[2])
    _teardown()
