"""One DPO benchmark run on one rank (launched by torchrun): a policy at ZeRO-3 with AdamW beside a frozen reference
model at ZeRO-3 built through ``initialize()`` without an optimizer, under zero or DeepSpeed, trained with the DPO
sigmoid loss written out here (no TRL). Writes each step's time and loss as JSON.

Both models start from the same seeded Llama (the reference is the policy's starting point, as in DPO). Each row
pairs a prompt (the first half of a slice of text) with a chosen response (the text that follows) and a rejected one
(another slice); chosen and rejected go through each model in one forward, as TRL concatenates them. Loss:
``-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r)))``, averaged over the rows, where ``pi_*`` / ``ref_*`` are the
summed log-probabilities of the response tokens under the policy / reference.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from train_worker import BETAS, LR, UNIT_NUMEL, WD, batches, build_model, zero_like_config

BETA = 0.1  # DPO's temperature on the log-ratio margin


def pairs(steps: int, micro: int, seq: int, rank: int, world: int) -> list[torch.Tensor]:
    """Per step, ``2 micro`` rows of ``seq`` tokens: ``micro`` chosen (prompt + what follows it), then ``micro``
    rejected (the same prompt + the second half of another slice). The same for zero and DeepSpeed."""
    chosen = batches(steps, micro, seq, rank, world)
    other = batches(2 * steps, micro, seq, rank, world)[steps:]  # later draws of the same generator: other slices
    half = seq // 2
    return [torch.cat([c, torch.cat([c[:, :half], o[:, half:]], dim=1)]) for c, o in zip(chosen, other)]


def response_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of the response tokens (the second half) of each row: ``(rows,)`` float32."""
    half = ids.shape[1] // 2
    logp = torch.log_softmax(logits[:, half - 1 : -1].float(), dim=-1)
    return logp.gather(-1, ids[:, half:, None]).squeeze(-1).sum(-1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """DPO's sigmoid loss from the response log-probabilities of ``2 micro`` rows (chosen first, then rejected)."""
    micro = policy.shape[0] // 2
    margin = (policy[:micro] - reference[:micro]) - (policy[micro:] - reference[micro:])
    return -F.logsigmoid(BETA * margin).mean()


def configs(impl: str, micro: int, world: int) -> tuple[dict, dict]:
    """(policy config, reference config): DeepSpeed's keys identical for both implementations; zero's stage-3 units
    of one decoder layer (its own key, as in train_worker.py) added for zero."""
    policy = zero_like_config(3, micro, world)
    reference = {k: v for k, v in policy.items() if k not in ("zero_allow_untested_optimizer", "gradient_clipping")}
    reference["zero_optimization"] = {"stage": 3}
    if impl == "zero":
        for cfg in (policy, reference):
            cfg["zero_optimization"]["stage3_unit_numel"] = UNIT_NUMEL
    return policy, reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["zero", "deepspeed"])
    ap.add_argument("--stage", type=int, default=3, help="accepted for the launcher; both models run stage 3")
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=2, help="prompts per rank; each has a chosen and a rejected row")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    engine_mod = __import__(args.impl)
    if args.impl == "deepspeed":
        engine_mod.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = pairs(args.steps, args.micro, args.seq, rank, world)
    policy_cfg, ref_cfg = configs(args.impl, args.micro, world)
    policy, ref = build_model(args.size), build_model(args.size)
    n_params = sum(p.numel() for p in policy.parameters())
    for p in ref.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    t0 = time.perf_counter()
    engine, *_ = engine_mod.initialize(model=policy, optimizer=opt, config=policy_cfg)
    ref_engine, *_ = engine_mod.initialize(model=ref, config=ref_cfg)
    ref_engine.eval()
    initialize_s = time.perf_counter() - t0

    losses, times = [], []
    for ids in data:
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            ref_logps = response_logps(ref_engine(input_ids=ids).logits, ids)
        loss = dpo_loss(response_logps(engine(input_ids=ids).logits, ids), ref_logps)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = dict(impl=args.impl, size=args.size, world=world, params=n_params, initialize_s=initialize_s,
                  step_s=times, losses=losses, peak_rss_bytes=peak_rss)  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
