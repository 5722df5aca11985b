"""A plain Accelerate script (``Accelerator()``; the DeepSpeed config comes from ``accelerate launch``), for
test_accelerate_launch.py. On a machine without CUDA, Accelerate finds no distributed backend for DeepSpeed by
itself, so the script creates ``PartialState(backend="gloo")`` first when it runs DeepSpeed there.

Usage: hf_accelerate_launch_job.py OUT_DIR MODE (``ddp``: Accelerate's CPU DDP under torchrun, or
``deepspeed``). 12 micro-batches, gradient accumulation 2 and clipping 1.0 (from the launcher's config, or the DDP
run's own arguments). Rank 0 writes OUT_DIR/MODE.json with the per-micro-batch losses, the final parameters and
what Accelerate ran.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator, PartialState
from hf_accelerate_job import _teardown, data, model


def main(out: str, mode: str) -> None:
    if mode == "deepspeed":
        if not torch.cuda.is_available():
            PartialState(backend="gloo")
        accelerator = Accelerator()
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
    state = accelerator.get_state_dict(net)
    if accelerator.is_main_process:
        result = {"losses": losses, "params": {k: v.float().reshape(-1).tolist() for k, v in state.items()},
                  "type": str(accelerator.distributed_type), "processes": accelerator.num_processes,
                  "engine": f"{type(net).__module__}.{type(net).__name__}"}  # fmt: skip
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    _teardown()
