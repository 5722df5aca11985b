"""Accelerate on zero, launched by ``zero run [--as-deepspeed] --standalone --nproc-per-node 2`` (test_hf_trainer).

Usage: hf_accelerate_job.py OUT_DIR MODES, MODES ``ddp`` (Accelerate's CPU DDP) and/or ``zero2`` (a DeepSpeedPlugin
at ZeRO-2), comma-separated and run in one launch (job_modes.run_modes). 12 micro-batches, gradient accumulation 2,
clipping 1.0; ``save_state`` at the end. Rank 0 writes OUT_DIR/MODE.json with the per-micro-batch losses and the
final parameters' names and values.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from job_modes import run_modes
from transformers import LlamaConfig, LlamaForCausalLM

MICRO_BATCHES = 12


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=75, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def data(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, 97, (2, 16), generator=g) for _ in range(MICRO_BATCHES)]


def main(out: str, mode: str) -> None:
    if mode == "zero2":
        # No CUDA: Accelerate finds no backend for DeepSpeed by itself (see hf_trainer_job.py); give it gloo.
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                  "zero_optimization": {"stage": 2}}  # fmt: skip
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    else:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    net, opt = accelerator.prepare(net, opt)
    losses = []
    for ids in data(accelerator.process_index):
        with accelerator.accumulate(net):
            loss = net(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if mode == "ddp" and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    accelerator.save_state(os.path.join(out, f"{mode}-state"))
    state = accelerator.get_state_dict(net)
    if accelerator.is_main_process:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump({"losses": losses, "params": {k: v.float().reshape(-1).tolist() for k, v in state.items()}}, f)


def _teardown() -> None:
    """Ranks leave the process group together: a rank exiting while gloo still talks to it aborts with
    "terminate called without an active exception" (seen under load; ``zero train`` does the same)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run_modes(main, sys.argv[1], sys.argv[2])
    _teardown()
