"""GPU check for zero-kernels: build the CUDA ops, run their tests against torch, print a bandwidth benchmark.

Run on a machine with a CUDA GPU, a CUDA build of torch and nvcc, from the repository root:

    python packages/zero-kernels/gpu_check.py            # exit status 0 when the build and every test pass

Prints: the build time of the `cuda_ops` op, the pytest summary of tests/test_cuda_ops.py (CUDA tests included), and
GB/s of FusedAdam vs torch's fused AdamW (28 B/param/step) and of int8/int4 quantize/dequantize, against a device
copy (read + write) measured in the same run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _time_cuda(fn, reps: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def bench(n: int = 50_000_000) -> list[str]:
    """Median GB/s of each CUDA op on n fp32 elements, as markdown rows."""
    import torch

    import zero_kernels as zk

    rows = ["| op | ms | GB/s |", "|---|---|---|"]
    src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    sec = _time_cuda(lambda: dst.copy_(src))
    rows.append(f"| device copy (reference bandwidth) | {sec * 1e3:.2f} | {8 * n / sec / 1e9:.0f} |")
    for name, make in (
        ("zero_kernels FusedAdam", lambda ps: zk.FusedAdam(ps, lr=1e-3, weight_decay=0.01)),
        ("torch AdamW fused", lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)),
    ):
        ps = [torch.nn.Parameter(torch.randn(n // 8, device="cuda")) for _ in range(8)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = make(ps)
        sec = _time_cuda(opt.step)
        rows.append(f"| {name} (8 tensors) | {sec * 1e3:.2f} | {28 * n / sec / 1e9:.0f} |")
    for bits in (8, 4):
        data, scales = zk.quantize_blockwise(src, bits, 4096)
        sec = _time_cuda(lambda b=bits: zk.quantize_blockwise(src, b, 4096))
        rows.append(f"| quantize int{bits} | {sec * 1e3:.2f} | {(4 + bits / 8) * n / sec / 1e9:.0f} |")
        sec = _time_cuda(lambda d=data, s=scales, b=bits: zk.dequantize_blockwise(d, s, n, b, 4096))
        rows.append(f"| dequantize int{bits} | {sec * 1e3:.2f} | {(4 + bits / 8) * n / sec / 1e9:.0f} |")
    return rows


def main() -> int:
    import torch

    import zero_kernels as zk

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda})", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    start = time.perf_counter()
    zk.load("cuda_ops")  # raises BuildError with nvcc's message on failure
    print(f"cuda_ops loaded in {time.perf_counter() - start:.1f} s")
    tests = subprocess.run([sys.executable, "-m", "pytest", str(HERE / "tests" / "test_cuda_ops.py"), "-q", "-rs"])
    print("\n".join(bench()))
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())
