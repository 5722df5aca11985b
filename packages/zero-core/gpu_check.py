"""GPU check for zero-core: train ZeRO stage 3 on CUDA under the torch profiler and report whether the parameter
all-gathers ran on a stream of their own, overlapping compute (zero_core.comm_context), and whether the losses
match plain PyTorch on the same data.

Run on a machine with CUDA GPUs, from the repository root:

    python packages/zero-core/gpu_check.py                            # one process, one GPU (NCCL, 1 rank)
    torchrun --nproc-per-node N packages/zero-core/gpu_check.py       # NCCL across N GPUs

Without CUDA it prints "no CUDA" and exits 0 (CI). Exit status 1 when a check fails. Prints, on rank 0: the
streams the all-gather kernels and the compute kernels ran on, the share of all-gather kernel time that overlapped
compute kernels, the loss of each step next to the reference's, and the profile's zero:: ranges.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def _intervals_overlap(comm: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float:
    """Microseconds of ``comm`` intervals covered by the union of ``compute`` intervals."""
    merged: list[list[float]] = []
    for a, b in sorted(compute):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in merged)


def _streams(trace_path: str) -> dict:
    """GPU work of a chrome trace: the compute stream (most non-NCCL kernel time) and the all-gathers: NCCL
    all-gather kernels, or with one rank (NCCL then copies instead of launching kernels) every kernel or copy off
    the compute stream."""
    events = json.load(open(trace_path))["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    per_stream: dict = {}
    for e in gpu:
        if e["cat"] == "kernel" and "nccl" not in e["name"].lower():
            per_stream[e["args"].get("stream")] = per_stream.get(e["args"].get("stream"), 0) + e["dur"]
    main_stream = max(per_stream, key=per_stream.get) if per_stream else None
    compute = [e for e in gpu if e["args"].get("stream") == main_stream and "nccl" not in e["name"].lower()]
    gathers = [e for e in gpu if "allgather" in e["name"].lower()]
    if not gathers:
        gathers = [e for e in gpu if e["args"].get("stream") != main_stream]
    span = lambda es: [(e["ts"], e["ts"] + e["dur"]) for e in es]  # noqa: E731
    return {
        "gather_streams": sorted({e["args"].get("stream") for e in gathers}),
        "compute_streams": [main_stream],
        "gather_us": sum(e["dur"] for e in gathers),
        "overlap_us": _intervals_overlap(span(gathers), span(compute)),
    }


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("zero-core gpu_check: no CUDA, nothing to check")
        return 0
    import torch.distributed as dist
    from torch import nn

    from zero_core import ZeroConfig, ZeroRuntime

    if "RANK" in os.environ:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")

    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(12)]).to(device)

    steps, micro = 6, 8
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(micro * world, 2048, generator=gen).to(device) for _ in range(steps)]
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    ref_losses = []
    for x in data:
        loss = ref(x).square().mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    model = build()
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg)
    assert rt.comm_ctx.active, "CommContext inactive on CUDA"
    losses = []
    trace = os.path.join(tempfile.mkdtemp(), f"trace{rank}.json")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for i, x in enumerate(data):
        part = x[rank * micro : (rank + 1) * micro]
        if i == steps - 2:
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        loss = rt.module(part).square().mean()
        rt.backward(loss)
        rt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    prof.export_chrome_trace(trace)
    found = _streams(trace)
    if rank != 0:
        dist.destroy_process_group()
        return 0
    ranges = sorted({e.key for e in prof.key_averages() if e.key.startswith("zero::")})
    own = bool(found["gather_streams"]) and not set(found["gather_streams"]) & set(found["compute_streams"])
    share = found["overlap_us"] / found["gather_us"] if found["gather_us"] else 0.0
    close = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
    print(f"zero-core gpu_check: {world} rank(s), {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"all-gather kernels on streams {found['gather_streams']}; compute kernels on {found['compute_streams']}")
    print(f"gathers on their own stream: {'yes' if own else 'NO'}; all-gather kernel time {found['gather_us']:.0f} us, "
          f"{share:.0%} of it overlapping compute kernels")  # fmt: skip
    print("losses (zero stage 3 / torch):", ", ".join(f"{a:.5f}/{b:.5f}" for a, b in zip(losses, ref_losses)))
    print(f"losses match torch (rel 1e-3): {'yes' if close else 'NO'}; profiler ranges: {', '.join(ranges)}")
    dist.destroy_process_group()
    return 0 if own and close and share > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
