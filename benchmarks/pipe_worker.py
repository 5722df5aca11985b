"""One pipeline-parallelism benchmark run on one rank (launched by torchrun on 2 or 4 ranks, one stage each): the
main job's Llama cut into stages by ``zero_parallel.pipe.decoder_layers`` (embedding, decoder layers, norm, head),
trained for a few ``train_batch`` steps under zero (``--schedule 1f1b | eager_1f1b | interleaved | zero_bubble``)
or DeepSpeed 0.19.8's ``PipelineEngine`` (1F1B), AdamW (torch's), ZeRO-1, fp32 (``--bf16``: the ``bf16`` section
on, fp32 master weights); ``--schedule 1f1b-compiled`` (``eager_1f1b-compiled``) is that schedule after
``engine.compile()`` (inductor, each stage's layers, compiled at the first step's calls). Writes, as JSON: each
step's wall time, this stage's compute time in it (forward and backward passes, timed around the engine's
instructions), the step's loss, peak RSS and the load average at the end.

The bubble fraction of a step is ``1 - compute / wall`` on a stage, averaged over the stages. ``--stages 1`` on 2
ranks is data parallelism (dp=2, ZeRO-1) through the same engine, for bench_pipeline_budget.py.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist

from zero.train.model import build_model
from zero_parallel.pipe import causal_lm_loss, decoder_layers

VOCAB = 259


class Clock:
    """Seconds spent inside the wrapped calls since the last ``take()``."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0

        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def windows(step: int, micro: int, count: int, seq: int) -> list:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(count):
        x = torch.randint(0, VOCAB, (micro, seq), generator=g)
        out.append((x, x))
    return out


def config(micro: int, gas: int, schedule: str, bf16: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}  # fmt: skip
    if schedule in ("zero_bubble", "eager_1f1b"):
        cfg["pipeline"] = {"schedule": schedule}
    if bf16:  # bf16 weights and activations, fp32 master weights and optimizer state (both engines)
        cfg["bf16"] = {"enabled": True}
    return cfg


def build(
    impl: str,
    schedule: str,
    size: str,
    seq: int,
    micro: int,
    gas: int,
    clock: Clock,
    stages: int = 0,
    bf16: bool = False,
):
    compiled = schedule.endswith("-compiled")
    schedule = schedule.removesuffix("-compiled")
    engine = _build(impl, schedule, size, seq, micro, gas, clock, stages, bf16)
    if compiled:
        engine.compile(backend="inductor")
    return engine


def _build(impl: str, schedule: str, size: str, seq: int, micro: int, gas: int, clock: Clock, stages: int, bf16: bool):
    model = build_model(size, seq, 1234)
    layers = decoder_layers(model)
    del model  # the layers hold the weights; a stage keeps its own
    world = stages or int(os.environ["WORLD_SIZE"])
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    if impl == "deepspeed":
        import deepspeed
        from deepspeed.runtime.pipe import schedule as ds_schedule
        from deepspeed.runtime.pipe.engine import PipelineEngine

        deepspeed.init_distributed(dist_backend="gloo")
        module = deepspeed.pipe.PipelineModule(layers, num_stages=world, loss_fn=causal_lm_loss)
        table = PipelineEngine._INSTRUCTION_MAP
        for kind in (ds_schedule.ForwardPass, ds_schedule.BackwardPass):
            table[kind] = clock.wrap(table[kind])
        engine, *_ = deepspeed.initialize(model=module, optimizer=make(module.parameters()),
                                          config=config(micro, gas, "1f1b", bf16))  # fmt: skip
        return engine
    import zero
    from zero_parallel.pipe import PipelineModule

    zero.init_distributed()
    virtual = 2 if schedule == "interleaved" else 1
    module = PipelineModule(layers, num_stages=world, loss_fn=causal_lm_loss, virtual_stages=virtual,
                            partition_method="uniform" if virtual > 1 else "parameters")  # fmt: skip
    engine, *_ = zero.initialize(model=module, optimizer=make, config=config(micro, gas, schedule, bf16))
    ex = engine.executor
    # a zero-bubble input pass runs through _backward; its weight pass is _weight_backward
    ex._forward, ex._backward, ex._weight_backward = (clock.wrap(ex._forward), clock.wrap(ex._backward),
                                                      clock.wrap(ex._weight_backward))  # fmt: skip
    return engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("zero", "deepspeed"), required=True)
    ap.add_argument(
        "--schedule",
        choices=("1f1b", "1f1b-compiled", "eager_1f1b", "eager_1f1b-compiled", "interleaved", "zero_bubble"),
        default="1f1b",
    )
    ap.add_argument("--size", default="6m")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--gas", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=0, help="pipeline stages (0: one per rank; 1: data parallel)")
    ap.add_argument("--bf16", action="store_true", help="bf16 section enabled (fp32 master weights)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = Clock()
    engine = build(args.impl, args.schedule, args.size, args.seq, args.micro, args.gas, clock, args.stages, args.bf16)
    rank = dist.get_rank()
    wall, compute, losses = [], [], []
    for step in range(args.steps):
        data = iter(windows(step, args.micro, args.gas, args.seq))
        dist.barrier()
        clock.take()
        t0 = time.perf_counter()
        loss = engine.train_batch(data)
        wall.append(time.perf_counter() - t0)
        compute.append(clock.take())
        losses.append(float(loss))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "stage": int(engine.stage_id), "wall_s": wall, "compute_s": compute, "loss": losses,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
              "loadavg": os.getloadavg()[0]}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
