"""GPU check of zero-offload (run by gpu/run.py): step time without offload, with ZeRO-Offload, with
SuperOffload and with stage 3's parameter offload on one CUDA GPU, same model, same data, in one run; and whether
the host<->device copies overlapped compute.

Run on a machine with a CUDA GPU and a CUDA build of torch, from the repository root:

    python gpu/offload.py [--layers 8 --hidden 2048 --steps 12]

Prints one row per mode (median step seconds without the first 2 steps) and the ratios SuperOffload claims
(<= 1.1x no offload, <= 0.7x ZeRO-Offload; reported, not enforced). Then, for ZeRO-Offload, SuperOffload and
parameter offload, one profiled step (torch.profiler, CUDA activity): per direction (host->device, device->host), the
share of copy time that ran while a kernel was running (1.0: every copy hidden behind compute; 0.0: copies and
compute serialised). Kernels are the device events that are neither copies, memsets nor the profiler's GPU-side
ranges of ``record_function`` blocks (a ``zero::`` range spans the copies issued inside it).
Without CUDA it prints "no CUDA" and exits 0.
World size 1 (gloo process group on localhost), bf16 parameters, AdamW, no clipping; stage 2 for the optimizer
modes, stage 3 (persistence threshold 0: every layer gathered) for ``param`` (``offload_param`` cpu, pinned) and
``param_none`` (stage 3 without offload, its reference).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

MODES = ("none", "cpu", "super", "param_none", "param")


def overlap_fraction(copies: list[tuple[float, float]], kernels: list[tuple[float, float]]) -> float | None:
    """Share of the total copy time (intervals ``(start, end)``, any unit) covered by the union of ``kernels``;
    None without copies."""
    total = sum(e - s for s, e in copies)
    if total <= 0:
        return None
    merged: list[list[float]] = []
    for s, e in sorted(kernels):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    covered = 0.0
    for s, e in copies:
        covered += sum(max(0.0, min(e, ke) - max(s, ks)) for ks, ke in merged)
    return covered / total


def _model(layers: int, hidden: int):
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.Sequential(*blocks).cuda()


def _runtime(mode: str, layers: int, hidden: int):
    import torch

    from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
    from zero_offload import OffloadMaster, OffloadParamStore

    model = _model(layers, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    master = params = None
    if mode in ("cpu", "super"):
        master = OffloadMaster.builder("cpu", pin_memory=True, super_offload=mode == "super",
                                       sub_group_size=hidden * hidden)  # fmt: skip
    if mode == "param":
        params = OffloadParamStore(pin_memory=True)
    stage3 = mode.startswith("param")
    cfg = ZeroConfig(stage=3 if stage3 else 2, overlap_comm=True, stage3_param_persistence_threshold=0)
    precision = PrecisionPolicy.bf16(compute_dtype=torch.bfloat16)  # bf16 forward (the default is fp32, for CPUs)
    return ZeroRuntime(model, opt, cfg, precision, master_store=master, param_store=params)


def _step(rt, x) -> float:
    loss = rt.module(x).float().square().mean()
    rt.backward(loss, is_boundary=True)
    rt.step()
    return float(loss)


def _run(mode: str, layers: int, hidden: int, steps: int) -> tuple[float, float]:
    import torch

    rt = _runtime(mode, layers, hidden)
    x = torch.randn(16, 512, hidden, device="cuda", dtype=torch.bfloat16)
    times, loss = [], None
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = _step(rt, x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rt.close()
    return statistics.median(times[2:]), loss


def _overlap(mode: str, layers: int, hidden: int) -> dict[str, tuple[float | None, int]]:
    """One profiled step after two warm-up steps: per direction ("htod", "dtoh"), (share of copy time overlapped by
    kernels, number of copies)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    rt = _runtime(mode, layers, hidden)
    x = torch.randn(16, 512, hidden, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        _step(rt, x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(rt, x)
        torch.cuda.synchronize()
    rt.close()
    copies, kernels = {"htod": [], "dtoh": []}, []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.is_user_annotation:
            continue
        span = (ev.time_range.start, ev.time_range.end)
        name = ev.name.lower()
        way = "htod" if "htod" in name else "dtoh" if "dtoh" in name else None
        if "memcpy" in name and way:
            copies[way].append(span)
        elif "memcpy" not in name and "memset" not in name and not name.startswith(("zero::", "profilerstep")):
            kernels.append(span)
    return {way: (overlap_fraction(spans, kernels), len(spans)) for way, spans in copies.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA: nothing to check here (run on a machine with a GPU)")
        return 0
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    print(f"GPU {torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores, {args.layers} x {args.hidden}")
    res = {m: _run(m, args.layers, args.hidden, args.steps) for m in MODES}
    for m, (t, loss) in res.items():
        print(f"| {m:<10} | {t:.3f} s/step | last loss {loss:.5f} |")
    s, n, c = res["super"][0], res["none"][0], res["cpu"][0]
    print(f"SuperOffload / no offload = {s / n:.2f}x (goal <= 1.1); SuperOffload / ZeRO-Offload = {s / c:.2f}x "
          f"(goal <= 0.7)")  # fmt: skip
    print(f"offload_param / stage 3 without offload = {res['param'][0] / res['param_none'][0]:.2f}x")
    for m in ("cpu", "super", "param"):
        for way, (frac, count) in _overlap(m, args.layers, args.hidden).items():
            shown = "no copies seen" if frac is None else f"{frac:.2f} of their time overlapped a kernel"
            print(f"copies {m:<6}: {count} {way} copies in one step, {shown}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
