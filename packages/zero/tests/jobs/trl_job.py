"""TRL's trainers as a user runs them, on 2 CPU ranks (see test_trl_trainers.py). The script imports trl,
transformers and datasets (and Accelerate, only to start each trainer from a fresh process-wide state) and never
zero or deepspeed: the DeepSpeed config goes through the trainer's config (``SFTConfig(deepspeed=...)``,
``DPOConfig(deepspeed=...)``), and ``zero run --as-deepspeed`` serves ``import deepspeed`` from zero.

Usage: trl_job.py OUT_DIR MODES, MODES ``ddp`` (SFTTrainer and DPOTrainer without a DeepSpeed config: the
trainers' own CPU DDP) and/or ``zero`` (the same SFTTrainer at ZeRO-3; DPOTrainer with a reference model at ZeRO-2,
then at ZeRO-3; DPOTrainer with a policy and a reference loaded from one saved model, under a user's own ZeRO-2
and ZeRO-3 configs), comma-separated and run in one launch (job_modes.run_modes). fp32, 4 optimizer steps each.
Rank 0 writes OUT_DIR/MODE.json: per run, the per-step losses, the class of the wrapped model; under zero also the
engine's ZeRO stage and, for DPO, the reference engine's class, stage, whether it has no optimizer, and after
training how many of its parameters are released (empty: partitioned) and the largest one held whole; for the
same-start DPO runs whether the reference's weights stayed as loaded and the dtype the policy trained in.
"""

from __future__ import annotations

import json
import os
import random
import sys

import torch
from accelerate.state import AcceleratorState
from datasets import Dataset
from hf_trainer_job import DS_CONFIG, DS_CONFIG_ZERO2, Losses, _teardown, model
from job_modes import run_modes
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

# The tokenizer's vocabulary is the words of this text (fewer than the tiny model's 97 embeddings).
TEXT = """the quick brown fox jumps over a lazy dog while seven small birds sing in green trees near an old
stone bridge where children play with red kites under bright summer skies and cold rivers run past quiet
farms full of tall wheat golden corn sleepy cows happy pigs busy bees"""
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built from ``TEXT`` (no download): ids 0-2 are the specials, then the sorted words."""
    vocab = {word: i for i, word in enumerate(SPECIALS + sorted(set(TEXT.split())))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _sentences(seed: int, count: int, low: int, high: int) -> list[str]:
    words, rng = sorted(set(TEXT.split())), random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(low, high))) for _ in range(count)]


def sft_data() -> Dataset:
    return Dataset.from_dict({"text": _sentences(1, 32, 6, 14)})


def dpo_data() -> Dataset:
    prompt, chosen, rejected = _sentences(2, 32, 3, 6), _sentences(3, 32, 2, 5), _sentences(4, 32, 2, 5)
    return Dataset.from_dict({"prompt": prompt, "chosen": chosen, "rejected": rejected})


def _common(out: str, name: str, deepspeed: dict | None) -> dict:
    return dict(
        output_dir=os.path.join(out, name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=1e-3, warmup_steps=1, weight_decay=0.01, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, ddp_backend="gloo",
        disable_tqdm=True, lr_scheduler_type="linear", bf16=False, use_cpu=True, deepspeed=deepspeed,
    )  # fmt: skip


def _wrapped(trainer) -> str:
    cls = type(trainer.model_wrapped)
    return f"{cls.__module__}.{cls.__name__}"


def run_sft(out: str, name: str, deepspeed: dict | None) -> dict:
    args = SFTConfig(**_common(out, name, deepspeed), max_length=16)
    losses = Losses()
    trainer = SFTTrainer(model=model(), args=args, train_dataset=sft_data(), processing_class=tokenizer(),
                         callbacks=[losses])  # fmt: skip
    trainer.train()
    result = {"losses": losses.losses, "wrapped": _wrapped(trainer), "world": args.world_size}
    if deepspeed is not None:
        result["stage"] = trainer.model_wrapped.zero_optimization_stage()
    return result


def run_dpo(out: str, name: str, deepspeed: dict | None) -> dict:
    args = DPOConfig(**_common(out, name, deepspeed), max_length=16, beta=0.1)
    policy = model()
    torch.manual_seed(1)  # a reference unlike the policy: the first loss then depends on both models
    reference = LlamaForCausalLM(policy.config)
    losses = Losses()
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dpo_data(),
                         processing_class=tokenizer(), callbacks=[losses])  # fmt: skip
    trainer.train()
    result = {"losses": losses.losses, "wrapped": _wrapped(trainer), "world": args.world_size}
    if deepspeed is not None:  # the reference model went through TRL's prepare_deepspeed: an engine of its own
        ref = trainer.ref_model
        whole = [p.numel() for p in ref.module.parameters() if p.numel() > 0]
        result.update(stage=trainer.model_wrapped.zero_optimization_stage(), reference=type(ref).__name__,
                      reference_stage=ref.zero_optimization_stage(), reference_without_optimizer=ref.optimizer is None,
                      reference_released=len(list(ref.module.parameters())) - len(whole),
                      reference_largest_whole=max(whole, default=0), hidden=policy.config.hidden_size)  # fmt: skip
    return result


# A DPO user's own DeepSpeed configs: explicit clipping, ZeRO-2 with overlapped reduction, ZeRO-3's threshold.
DS_USER = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "allgather_bucket_size": 5e8, "reduce_bucket_size": 5e8, "overlap_comm": True},
}  # fmt: skip
DS_USER_ZERO3 = {**DS_USER, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e5}}


def _param_sum(net) -> float:
    """The sum of every parameter in float64 (gathered first when partitioned: a collective under ZeRO-3)."""
    params = list(net.parameters())
    if any(p.numel() == 0 for p in params):
        import deepspeed  # served by zero

        with deepspeed.zero.GatheredParameters(params):
            return float(sum(p.detach().double().sum() for p in params))
    return float(sum(p.detach().double().sum() for p in params))


def run_dpo_same_start(out: str, name: str, deepspeed: dict | None) -> dict:
    """DPO as its guides show it: the policy and the reference loaded from one saved model (the same weights),
    4 sequences per rank without accumulation, bf16 off (TRL's default turns it on: under DeepSpeed, Accelerate
    then adds ``bf16.enabled`` to the config and the engine trains bf16 weights, while DDP keeps fp32 weights under
    bf16 autocast, two different computations)."""
    args = DPOConfig(output_dir=os.path.join(out, name), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                     max_length=64, beta=0.1, logging_steps=1, seed=0, use_cpu=True, ddp_backend="gloo", bf16=False,
                     save_strategy="no", report_to=[], disable_tqdm=True, deepspeed=deepspeed)  # fmt: skip
    saved = os.path.join(out, f"{name}_start")
    with args.main_process_first(local=False):  # save_pretrained writes on the main process only
        if args.process_index == 0:
            model().save_pretrained(saved)
    policy, reference = LlamaForCausalLM.from_pretrained(saved), LlamaForCausalLM.from_pretrained(saved)
    losses = Losses()
    trainer = DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=dpo_data(),
                         processing_class=tokenizer(), callbacks=[losses])  # fmt: skip
    ref = trainer.ref_model.module if deepspeed is not None else trainer.ref_model
    before = _param_sum(ref)
    trainer.train()
    return {"losses": losses.losses, "reference_unchanged": _param_sum(ref) == before,
            "trained_dtype": str(next(trainer.model_wrapped.parameters()).dtype)}  # fmt: skip


def main(out: str, mode: str) -> None:
    plans = {"zero": [("sft_zero3", run_sft, DS_CONFIG), ("dpo_zero2", run_dpo, DS_CONFIG_ZERO2),
                      ("dpo_zero3", run_dpo, DS_CONFIG), ("dpo_same_start_zero2", run_dpo_same_start, DS_USER),
                      ("dpo_same_start_zero3", run_dpo_same_start, DS_USER_ZERO3)],
             "ddp": [("sft", run_sft, None), ("dpo", run_dpo, None),
                     ("dpo_same_start", run_dpo_same_start, None)]}  # fmt: skip
    runs = {}
    for name, run, deepspeed in plans[mode]:
        # Accelerate keeps one process-wide state, with the first trainer's DeepSpeed config: each trainer of this
        # script starts from a fresh one, as in a script of its own
        AcceleratorState._reset_state()
        runs[name] = run(out, name, deepspeed)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    run_modes(main, sys.argv[1], sys.argv[2])
    _teardown()
