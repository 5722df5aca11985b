"""One ZenFlow benchmark run on one rank (launched by torchrun): two engines built from the same initial Llama,
ZeRO-Offload (``offload_optimizer`` cpu) and ZenFlow (the same plus the ``zenflow`` section), trained on the same
batches in interleaved blocks of ``--block`` steps (the machine's load drift hits both alike). Two phases: from
scratch for ``--steps`` steps, then fine-tuning for ``--finetune`` steps: a fresh pair of engines (fresh optimizer
state) starts from the weights ZeRO-Offload reached in the first phase, on the batches that follow. Writes each
phase's per-engine step times and losses as JSON.

Before each block the other engine's host step in flight is waited for, untimed, so neither is timed while the
other's ZenFlow worker runs.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero_offload import ZenFlowMaster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_worker import BETAS, LR, WD, batches, build_model  # noqa: E402

# DeepSpeed's ZenFlow tutorial settings (a tenth of each matrix's columns on the device, the other columns stepped
# on the host every 4 steps, overlapped), columns re-selected every 20 steps for a run this short
ZENFLOW = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 20, "update_interval": 4,
           "overlap_step": True, "full_warm_up_rounds": 0}  # fmt: skip


def config(micro: int, world: int, zenflow: bool) -> dict:
    zo: dict = {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if zenflow:
        zo["zenflow"] = dict(ZENFLOW)
    return {
        "train_batch_size": micro * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8, "weight_decay": WD}},
        "gradient_clipping": 1.0,
        "zero_optimization": zo,
        "steps_per_print": 10**9,
    }


def train_pair(model: torch.nn.Module, data: list, args: argparse.Namespace, world: int) -> dict:
    """Train ZeRO-Offload and ZenFlow copies of ``model`` on ``data`` in interleaved blocks; their step times and
    losses, ZenFlow's host-update trace summary and (under ``weights``) ZeRO-Offload's final weights."""
    import zero

    engines = {}
    for name, zen in (("offload", False), ("zenflow", True)):
        m = copy.deepcopy(model)
        engines[name], *_ = zero.initialize(model=m, model_parameters=m.parameters(), config=config(args.micro,
                                            world, zen))  # fmt: skip
    res = {name: {"step_s": [], "losses": []} for name in engines}
    for start in range(0, len(data), args.block):
        for name, engine in engines.items():
            for other in engines.values():  # no host step of the other engine runs during this block
                if isinstance(other.runtime.master, ZenFlowMaster):
                    other.runtime.master.wait_host_step()
            for batch in data[start : start + args.block]:
                dist.barrier()
                t0 = time.perf_counter()
                loss = engine(input_ids=batch, labels=batch).loss
                engine.backward(loss)
                engine.step()
                res[name]["step_s"].append(time.perf_counter() - t0)
                res[name]["losses"].append(loss.item())
    trace = engines["zenflow"].runtime.master.trace
    res["host_updates"] = len(trace)
    res["max_lag"] = max((u.applied - u.last for u in trace), default=0)
    res["weights"] = {k: v.detach().clone() for k, v in engines["offload"].module.state_dict().items()}
    for engine in engines.values():
        engine.destroy()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6m")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--finetune", type=int, default=0)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.steps + args.finetune, args.micro, args.seq, rank, world)
    model = build_model(args.size)
    res = {"scratch": train_pair(model, data[: args.steps], args, world)}
    if args.finetune:
        pretrained = build_model(args.size)
        pretrained.load_state_dict(res["scratch"]["weights"])
        res["finetune"] = train_pair(pretrained, data[args.steps :], args, world)
    for phase in res.values():
        del phase["weights"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
