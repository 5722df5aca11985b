"""GPU check for zero-offload (issue 13's device rows): step time without offload, with ZeRO-Offload and with
SuperOffload on one CUDA GPU, same model, same data, in one run.

Run on a machine with a CUDA GPU and a CUDA build of torch, from the repository root:

    python packages/zero-offload/gpu_check.py [--layers 8 --hidden 2048 --steps 12]

Prints one row per mode (median step seconds without the first 2 steps) and the ratios the issue asks for:
SuperOffload <= 1.1x no offload and <= 0.7x ZeRO-Offload. Without CUDA it prints "no CUDA" and exits 0.
World size 1 (gloo process group on localhost), stage 2, bf16 parameters, AdamW, no clipping.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _model(layers: int, hidden: int):
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)]
    return torch.nn.Sequential(*blocks).cuda()


def _run(mode: str, layers: int, hidden: int, steps: int) -> tuple[float, float]:
    import torch

    from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
    from zero_offload import OffloadMaster

    model = _model(layers, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    master = None
    if mode != "none":
        master = OffloadMaster("cpu", pin_memory=True, super_offload=mode == "super", sub_group_size=hidden * hidden)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=2, overlap_comm=True), PrecisionPolicy.bf16(), master_store=master)
    x = torch.randn(16, 512, hidden, device="cuda", dtype=torch.bfloat16)
    times, loss = [], None
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = rt.module(x).float().square().mean()
        rt.backward(loss, is_boundary=True)
        rt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    rt.close()
    return statistics.median(times[2:]), float(loss)


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
    res = {m: _run(m, args.layers, args.hidden, args.steps) for m in ("none", "cpu", "super")}
    for m, (t, loss) in res.items():
        print(f"| {m:<5} | {t:.3f} s/step | last loss {loss:.5f} |")
    s, n, c = res["super"][0], res["none"][0], res["cpu"][0]
    print(f"SuperOffload / no offload = {s / n:.2f}x (goal <= 1.1); SuperOffload / ZeRO-Offload = {s / c:.2f}x "
          f"(goal <= 0.7)")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
