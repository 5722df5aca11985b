"""One inference benchmark run on one rank (launched by torchrun): forward passes of a frozen Llama, either dense in
every rank or through zero's ZeRO-3 engine built without an optimizer (ZeRO-Inference), and the rank's peak RSS.

``--impl dense``: the model built whole in each rank. ``--impl zero``: built under ``zero.zero.Init`` (each
module's parameters partitioned as it is constructed, so no rank ever holds the whole model), then
``zero.initialize(model=..., config=...)`` with no optimizer; one unit per decoder layer (``stage3_unit_numel``),
and ``--max-live`` bounds the elements gathered at once (prefetch stops there). Writes rank 0's JSON with the
largest of the ranks' RSS figures: the peak growth over the whole run, and per phase (the build; serving:
``initialize`` and the forwards), the peak of each phase read from VmHWM after resetting it (/proc/self/clear_refs)
when the phase starts.
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
from train_worker import UNIT_NUMEL, batches, build_model, status_bytes


def _required(field: str) -> int:
    value = status_bytes(field)
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return value


def rss_now() -> int:
    """This process's resident set size now, bytes (``VmRSS`` of /proc/self/status)."""
    return _required("VmRSS")


def hwm_now() -> int:
    """This process's peak resident set size since the last :func:`reset_hwm`, bytes (``VmHWM``)."""
    return _required("VmHWM")


def reset_hwm() -> None:
    """Start a new peak: VmHWM := VmRSS (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """This process's peak resident set size so far, bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def architecture_numels(size: str) -> tuple[int, int]:
    """(parameters in the model, parameters of its largest decoder layer) from a build on the meta device."""
    from transformers import LlamaForCausalLM

    from zero.train.model import llama_config

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(size, seq_len=512))
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    return sum(p.numel() for p in model.parameters()), layer


def zero_config(micro: int, max_live: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "zero_optimization": {
            "stage": 3,
            "stage3_unit_numel": UNIT_NUMEL,  # zero's own key: one unit per decoder layer
            "stage3_max_live_parameters": max_live,
            "stage3_prefetch_bucket_size": min(max_live, 50_000_000),
        },
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", required=True, choices=["zero", "dense"])
    ap.add_argument("--stage", type=int, default=3, help="accepted for the launcher; zero runs stage 3")
    ap.add_argument("--size", default="60m")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--max-live", type=int, default=1_000_000_000, help="stage3_max_live_parameters (zero)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches(args.steps, args.micro, args.seq, rank, world)
    import transformers  # noqa: F401 - loaded before the baseline, so the figure is the model's, not the library's

    import zero

    # the modeling code imported (a meta build) before the baseline: its pages are neither impl's model
    n_params, largest_unit = architecture_numels(args.size)
    # the dense peer gets the allocator setting zero's engine makes (zero_core.materialize): the same glibc rules
    from zero_core.materialize import pin_host_mmap_threshold

    pin_host_mmap_threshold()
    base_rss, base_peak = rss_now(), peak_rss()
    reset_hwm()
    if args.impl == "zero":
        cfg = zero_config(args.micro, args.max_live)
        with zero.zero.Init(config_dict_or_path=cfg):
            model = build_model(args.size)
        build_peak = hwm_now()
        reset_hwm()
        engine, *_ = zero.initialize(model=model, config=cfg)
        engine.eval()
        forward = engine
    else:
        model = build_model(args.size)
        model.eval()
        forward = model
        build_peak = hwm_now()
        reset_hwm()
    serve_start = rss_now()
    times, sums = [], []
    for batch in data:
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            logits = forward(input_ids=batch).logits
        times.append(time.perf_counter() - start)
        sums.append(logits.double().sum().item())
    serve_peak = hwm_now()
    figures = [peak_rss() - base_rss, base_rss, base_peak, peak_rss(), build_peak - base_rss, serve_peak - base_rss,
               serve_start - base_rss]  # fmt: skip
    figures = torch.tensor(figures, dtype=torch.float64)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    result = dict(impl=args.impl, size=args.size, world=world, params=n_params, largest_unit=largest_unit,
                  max_live=args.max_live, step_s=times, logit_sums=sums,
                  rss_growth_bytes=figures[0].item(), base_rss_bytes=figures[1].item(),
                  base_peak_bytes=figures[2].item(), peak_rss_bytes=figures[3].item(),
                  build_growth_bytes=figures[4].item(), serve_growth_bytes=figures[5].item(),
                  serve_start_bytes=figures[6].item())  # fmt: skip
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
