"""One compiled-path benchmark run on one rank (launched by torchrun): zero's engine on the main job's Llama at one
ZeRO stage, as "eager", "torch_compile" (plain torch.compile of the module) or "deepcompile" (zero_compile's
passes), inductor for both compiled modes, or "floor": no engine, no optimizer, no communication, only plain
torch.compile (inductor) of the model's forward and backward on each rank's own micro-batch, the compute that every
mode runs and no compiler pass over ZeRO can remove (the lower bound of a step here). Writes rank<r>.json with the
first-step (compile) time, the later step times, the all-gathers per optimizer step (zero_comm's CommsLogger) and
the graphs compiled after warm-up."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_worker import batches, build_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["eager", "torch_compile", "deepcompile", "floor"], required=True)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--size", default="20m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--acc", type=int, default=1)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import zero
    from zero_comm import CommsLogger

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(args.size)
    cfg = {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.acc,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "steps_per_print": 10**9,
           "zero_optimization": {"stage": args.stage, "overlap_comm": True},
           "compile": {"deepcompile": args.mode == "deepcompile", "backend": args.backend, "warmup_steps": 2},
           "torch_compile": {"enabled": args.mode == "torch_compile", "backend": args.backend}}  # fmt: skip
    engine = (
        Floor(model)
        if args.mode == "floor"
        else zero.initialize(model=model, config=cfg, model_parameters=model.parameters())[0]
    )
    data = batches(args.steps * args.acc, args.micro, args.seq, rank, world)
    step_s, gathers, losses = [], [], []
    for step in range(args.steps):
        t0 = time.perf_counter()
        with CommsLogger() as log:
            for micro in range(args.acc):
                ids = data[step * args.acc + micro]
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
        step_s.append(time.perf_counter() - t0)
        gathers.append(log.count("all_gather_into_tensor"))
        losses.append(float(loss.detach()))
    path = None if args.mode == "floor" else getattr(engine.runtime.reducer, "path", None)
    compiles = [c[0] for c in path.compiled.compiles] if path is not None else []
    res = dict(mode=args.mode, stage=args.stage, acc=args.acc, step_s=step_s, gathers=gathers, losses=losses,
               graphs_compiled_by_step=compiles, cpu_threads=torch.get_num_threads())  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()


class Floor:
    """The "floor" mode: ``torch.compile(model)`` forward and backward, gradients dropped at each step (no
    optimizer, no collective), with the engine's call surface."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.fn = model, torch.compile(model)

    def __call__(self, **kwargs):
        return self.fn(**kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def destroy(self) -> None:
        """Nothing to release."""


if __name__ == "__main__":
    main()
