"""One ZenFlow benchmark run on one rank (launched by torchrun): engines built from the same Llama, ZeRO-Offload
(``offload_optimizer`` cpu) and ZenFlow settings (the same plus a ``zenflow`` section, :data:`SETTINGS`), trained on
the same batches in interleaved blocks of ``--block`` steps (the machine's load drift hits all alike). The model
starts from its seeded construction (from scratch) or from a state dict (``--init``: fine-tuning, after the
``--skip`` batches it was trained on). Writes each engine's step times and losses, and each ZenFlow engine's
host-update count and largest lag, as JSON.

Before each block every other engine's host step in flight is waited for, untimed, so no engine is timed while
another's ZenFlow worker runs.
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

# ZenFlow settings by name. "zenflow": the tutorial's update_interval 4 and overlap_step with a tenth of each
# matrix's columns on the device, re-selected every 20 steps (the from-scratch table); "tutorial": DeepSpeed's
# ZenFlow tutorial config as written (columns selected once per epoch: once in a run this short); "defaults": an
# empty section, DeepSpeed 0.19.8's defaults (update_interval "auto", no overlap).
SETTINGS = {
    "zenflow": {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 20, "update_interval": 4,
                "overlap_step": True, "full_warm_up_rounds": 0},
    "tutorial": {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
                 "full_warm_up_rounds": 0, "overlap_step": True},
    "defaults": {},
}  # fmt: skip
ZENFLOW = SETTINGS["zenflow"]


def config(micro: int, world: int, engine: str) -> dict:
    """The DeepSpeed config of ``engine``: "offload" (plain ZeRO-Offload) or a name in :data:`SETTINGS`."""
    zo: dict = {"stage": 2, "overlap_comm": True, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    if engine != "offload":
        zo["zenflow"] = dict(SETTINGS[engine])
    return {
        "train_batch_size": micro * world,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": 1e-8, "weight_decay": WD}},
        "gradient_clipping": 1.0,
        "zero_optimization": zo,
        "steps_per_print": 10**9,
    }


def train_engines(model: torch.nn.Module, data: list, args: argparse.Namespace, world: int) -> dict:
    """Train a copy of ``model`` per engine of ``--engines`` on ``data`` in interleaved blocks; per engine its step
    times and losses (and for ZenFlow its host-update count and the most any lagged behind its last gradient)."""
    import zero

    engines = {}
    for name in args.engines.split(","):
        m = copy.deepcopy(model)
        engines[name], *_ = zero.initialize(model=m, model_parameters=m.parameters(), config=config(args.micro,
                                            world, name))  # fmt: skip
    res = {name: {"step_s": [], "losses": []} for name in engines}
    for start in range(0, len(data), args.block):
        for name, engine in engines.items():
            for other in engines.values():  # no host step of another engine runs during this block
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
    for name, engine in engines.items():
        master = engine.runtime.master
        if isinstance(master, ZenFlowMaster):
            res[name]["host_updates"] = len(master.trace)
            res[name]["max_lag"] = max((u.applied - u.last for u in master.trace), default=0)
        engine.destroy()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="6m")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=0, help="batches before the first one trained on")
    ap.add_argument("--init", default="", help="state dict to start from (default: the seeded construction)")
    ap.add_argument("--engines", default="offload,zenflow", help="offload and names in SETTINGS, comma-separated")
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.skip + args.steps, args.micro, args.seq, rank, world)[args.skip :]
    model = build_model(args.size)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location="cpu", weights_only=True))
    res = train_engines(model, data, args, world)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
