"""CPU attention in bf16 and fp16: torch's ``scaled_dot_product_attention`` kernel in the reduced dtype against the
same call on inputs cast to fp32 and its output cast back (what zero_compile's cpu_attention pass makes of a call
where that is faster), forward and backward, one thread, for attention shapes ``[batch, heads, seq, head_dim]``
from short to long sequences; and a decoder layer of the main job's Llama (``6m``: hidden 256, 4 heads, seq 64,
micro-batch 2) in bf16 compiled with inductor as torch.compile gives it against zero's engine backend
(``CpuAttentionBackend``: the pass, then inductor), forward and backward. Medians of interleaved rounds.

Usage: python benchmarks/bench_cpu_attention.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(2, 4, 64, 64), (2, 4, 256, 64), (1, 16, 512, 32), (1, 8, 1024, 64), (1, 8, 2048, 128)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _attention_step(shape, dtype, fp32: bool):
    q, k, v = (torch.randn(shape, dtype=dtype).requires_grad_() for _ in range(3))

    def step():
        if fp32:
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).to(dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    return step


def _layer_steps():
    from zero.engine.compiled import torch_backend
    from zero.train.model import build_model
    from zero_parallel.pipe import decoder_layers

    layer = decoder_layers(build_model("6m", 64, 1234).to(torch.bfloat16))[1]
    plain, zero = copy.deepcopy(layer), layer
    plain.compile(backend="inductor")
    zero.compile(backend=torch_backend("inductor", zero))
    hidden = torch.randn(2, 64, 256, dtype=torch.bfloat16)

    def step(module):
        def run():
            x = hidden.clone().requires_grad_()
            out = module(x)
            out.backward(torch.ones_like(out))

        return run

    return step(plain), step(zero)


def _timed(steps: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median milliseconds of each step over ``rounds`` interleaved rounds of ``reps`` calls (every second round
    reversed), after 3 warm-up calls of each."""
    for fn in steps.values():
        for _ in range(3):
            fn()
    times = {name: [] for name in steps}
    for r in range(rounds):
        for name in list(steps) if r % 2 == 0 else list(steps)[::-1]:
            t0 = time.perf_counter()
            for _ in range(reps):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / reps * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 short shapes, 3 rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default 7 (3 with --quick)")
    args = ap.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 7)
    torch.set_num_threads(1)
    shapes = SHAPES[:2] if args.quick else SHAPES
    lines = [f"`python benchmarks/bench_cpu_attention.py{' --quick' if args.quick else ''}`: one thread, "
             f"{rounds} interleaved rounds, causal attention; load average (1 min) at the start "
             f"{os.getloadavg()[0]:.2f}.", "",
             "| shape [batch, heads, seq, head_dim] | dtype | kernel in the dtype, ms | fp32 on cast inputs, ms | "
             "fp32 / kernel |", "|---|---|---|---|---|"]  # fmt: skip
    for shape in shapes:
        for name, dtype in DTYPES.items():
            reps = max(1, min(20, int(2e6 / (shape[0] * shape[1] * shape[2] ** 2))))  # ~20 ms a round or 1 call
            got = _timed({"kernel": _attention_step(shape, dtype, False), "fp32": _attention_step(shape, dtype, True)},
                         rounds, reps)  # fmt: skip
            lines.append(f"| {list(shape)} | {name} | {got['kernel']:.3f} | {got['fp32']:.3f} | "
                         f"{got['fp32'] / got['kernel']:.2f}x |")  # fmt: skip
    plain, zero = _layer_steps()
    got = _timed({"inductor": plain, "zero": zero}, rounds, 20)
    lines += ["", "| the main job's decoder layer, bf16, forward + backward | ms | vs inductor |", "|---|---|---|",
              f"| torch.compile, inductor | {got['inductor']:.3f} | 1.00x |",
              f"| zero's engine backend (cpu_attention pass, inductor) | {got['zero']:.3f} | "
              f"{got['zero'] / got['inductor']:.2f}x |",
              f"\nLoad average (1 min) at the end {os.getloadavg()[0]:.2f}."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(main())
