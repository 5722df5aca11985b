"""GPU checks of zero-kernels (run by gpu/run.py): build the CUDA ops and run their tests; time them.

Run on a machine with a CUDA GPU, a CUDA build of torch and nvcc, from the repository root:

    python gpu/kernels.py tests     # build `cuda_ops`, run packages/zero-kernels/tests/test_cuda_ops.py
    python gpu/kernels.py bench     # GB/s of FusedAdam and quantize against the device copy bandwidth

``tests`` prints the build time of the `cuda_ops` op and the pytest summary (CUDA tests included); exit status 0
when the build and every test pass. ``bench`` prints GB/s of FusedAdam vs torch's fused AdamW (28 B/param/step)
and of int8/int4 quantize/dequantize, against a device copy (read + write) measured in the same run, and the forward +
backward time of a subchannel FP8/INT8 Linear against bf16's. Without CUDA either says "no CUDA" and exits 0.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def _kernel_ms(fn, reps: int = 5) -> float:
    """Milliseconds of CUDA kernel time per call of ``fn`` (torch profiler): the GPU's share, without host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels if "memcpy" not in e.name.lower()) / reps / 1e3


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
        ksec = _kernel_ms(opt.step) / 1e3
        rows.append(f"| {name}, kernels only | {ksec * 1e3:.2f} | {28 * n / ksec / 1e9:.0f} |")
    for bits in (8, 4):
        data, scales = zk.quantize_blockwise(src, bits, 4096)
        sec = _time_cuda(lambda b=bits: zk.quantize_blockwise(src, b, 4096))
        rows.append(f"| quantize int{bits} | {sec * 1e3:.2f} | {(4 + bits / 8) * n / sec / 1e9:.0f} |")
        sec = _time_cuda(lambda d=data, s=scales, b=bits: zk.dequantize_blockwise(d, s, n, b, 4096))
        rows.append(f"| dequantize int{bits} | {sec * 1e3:.2f} | {(4 + bits / 8) * n / sec / 1e9:.0f} |")
    rows += linear_rows()
    return rows


def linear_rows(tokens: int = 8192, width: int = 4096) -> list[str]:
    """Median ms of one Linear's forward + backward (bf16 x and weight, ``tokens`` x ``width`` -> ``width``): bf16
    ``F.linear`` against zero's subchannel FP8/INT8 layer (row scaling takes ``torch._scaled_mm`` where the device
    has FP8; blocks of 128 are emulated), as markdown rows (TFLOP/s counts the three GEMMs)."""
    import torch

    import zero_kernels as zk

    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(width, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    flops = 3 * 2 * tokens * width * width
    variants = [("bf16 F.linear", lambda: torch.nn.functional.linear(x, w))]
    for fmt, block in (("fp8", 0), ("fp8", 128), ("int8", 0)):
        spec = zk.GemmQuant(fmt, block)
        recipe = zk.LinearQuantRecipe(forward=spec, dx=spec, dw=spec)
        variants.append((f"{fmt} block {block}", lambda r=recipe: zk.subchannel_linear(x, w, None, r)))
    rows = [f"| Linear {tokens}x{width}->{width}, fwd+bwd | ms | TFLOP/s |", "|---|---|---|"]
    for name, fn in variants:
        sec = _time_cuda(lambda f=fn: torch.autograd.backward(f(), dy), reps=10)
        rows.append(f"| {name} | {sec * 1e3:.2f} | {flops / sec / 1e12:.0f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    part = (argv if argv is not None else sys.argv[1:]) or ["tests"]
    if part[0] not in ("tests", "bench"):
        print(f"usage: python gpu/kernels.py tests|bench (got {part[0]!r})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"no CUDA: nothing to check (torch {torch.__version__}, CUDA {torch.version.cuda})")
        return 0
    import zero_kernels as zk

    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if part[0] == "bench":
        print("\n".join(bench()))
        return 0
    start = time.perf_counter()
    zk.load("cuda_ops")  # raises BuildError with nvcc's message on failure
    print(f"cuda_ops built and loaded in {time.perf_counter() - start:.1f} s")
    test_file = ROOT / "packages" / "zero-kernels" / "tests" / "test_cuda_ops.py"
    tests = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-rs", "-p", "no:cacheprovider"])
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())
