"""GPU check of zero-core (run by gpu/run.py): train ZeRO stage 3 on CUDA under the torch profiler and report
whether the parameter all-gathers and the gradient reduce-scatters ran on streams of their own, overlapping compute
(zero_core.comm_context), and whether the losses match plain PyTorch on the same data.

Run on a machine with CUDA GPUs, from the repository root:

    python gpu/streams.py                                   # one process, one GPU (NCCL, 1 rank)
    torchrun --nproc-per-node N gpu/streams.py              # NCCL across N GPUs

Without CUDA it prints "no CUDA" and exits 0. Exit status 1 when a check fails. Prints, on rank 0: the streams
the all-gathers, the reductions and the compute kernels ran on, the share of each one's GPU time that overlapped
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


def _owners(events: list[dict]) -> dict[int, str]:
    """Correlation id -> the innermost ``zero::`` profiler range its CPU-side launch ran in."""
    ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("zero::")]
    owners = {}
    for e in events:
        corr = e.get("args", {}).get("correlation") if e.get("cat") in ("cuda_runtime", "cuda_driver") else None
        if corr is None:
            continue
        inside = [r for r in ranges if r.get("tid") == e.get("tid") and r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]
        if inside:
            owners[corr] = min(inside, key=lambda r: r["dur"])["name"]
    return owners


def _streams(trace_path: str) -> dict:
    """GPU work of a chrome trace: the compute stream (most non-NCCL kernel time), the all-gathers and the
    reductions. Communication is recognised by its NCCL kernel's name, else (one rank: NCCL copies instead of
    launching kernels) by the zero:: range (zero::gather, zero::reduce) its launch ran in, else as any work off
    the compute stream (a gather)."""
    events = json.load(open(trace_path))["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy")]
    per_stream: dict = {}
    for e in gpu:
        if e["cat"] == "kernel" and "nccl" not in e["name"].lower():
            per_stream[e["args"].get("stream")] = per_stream.get(e["args"].get("stream"), 0) + e["dur"]
    main_stream = max(per_stream, key=per_stream.get) if per_stream else None
    compute = [e for e in gpu if e["args"].get("stream") == main_stream and "nccl" not in e["name"].lower()]
    owners = _owners(events)

    def kind(e: dict) -> str | None:
        name = e["name"].lower()
        if "allgather" in name:
            return "gather"
        if "reducescatter" in name or "allreduce" in name:
            return "reduce"
        owner = owners.get(e["args"].get("correlation"), "")
        if owner.startswith("zero::gather"):
            return "gather"
        if owner.startswith("zero::reduce"):
            return "reduce"
        return "gather" if not owners and e["args"].get("stream") != main_stream else None

    span = lambda es: [(e["ts"], e["ts"] + e["dur"]) for e in es]  # noqa: E731
    out = {"compute_streams": [main_stream]}
    for name in ("gather", "reduce"):
        mine = [e for e in gpu if kind(e) == name]
        out[f"{name}_streams"] = sorted({e["args"].get("stream") for e in mine})
        out[f"{name}_us"] = sum(e["dur"] for e in mine)
        out[f"{name}_overlap_us"] = _intervals_overlap(span(mine), span(compute))
    return out


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: nothing to check")
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

    steps, micro = 6, 2048  # rows enough that a layer's matmul outlasts the next layer's gather
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
    # prefetch one layer ahead: all at once, the gathers (copies at 1 rank) finish before the host has launched
    # the first layer's compute, leaving nothing to overlap
    cfg = ZeroConfig(
        stage=3,
        stage3_param_persistence_threshold=0,
        stage3_max_reuse_distance=0,
        stage3_prefetch_bucket_size=2048 * 2048 + 2048,
    )
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
    close = all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(losses, ref_losses))
    print(f"zero-core streams check: {world} rank(s), {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"compute kernels on stream(s) {found['compute_streams']}")
    ok = close
    for name in ("gather", "reduce"):
        streams, busy = found[f"{name}_streams"], found[f"{name}_us"]
        if name == "reduce" and world == 1 and not busy:
            print("reduces: none at 1 rank (a rank's gradient is already the reduced one; run under torchrun with "
                  "2 or more GPUs to see them)")  # fmt: skip
            continue
        own = bool(streams) and not set(streams) & set(found["compute_streams"])
        share = found[f"{name}_overlap_us"] / busy if busy else 0.0
        print(f"{name}s on their own stream(s) {streams}: {'yes' if own else 'NO'}; {busy:.0f} us of GPU work, "
              f"{share:.0%} of it overlapping compute kernels")  # fmt: skip
        # at 1 rank a gather is a device copy of a few microseconds that the prefetch issues while the GPU idles
        # between the host's launches: overlap is only required where the gathers cross GPUs
        ok = ok and own and (share > 0 or world == 1)
    print("losses (zero stage 3 / torch):", ", ".join(f"{a:.5f}/{b:.5f}" for a, b in zip(losses, ref_losses)))
    print(f"losses match torch (rel 1e-3): {'yes' if close else 'NO'}; profiler ranges: {', '.join(ranges)}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
