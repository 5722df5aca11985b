"""Subchannel quantized training (the `quantization` section): the quantized Linear's error against the rule and
against the unquantized Linear, and the main job's loss with the section on against bf16 and fp32 training.

1. Linear: the main job's Llama 20m Linear shapes at its micro-batch (4 x 127 tokens), Gaussian data; forward
   output and both gradients of ``zero_kernels.SubchannelLinear`` against a reference computed here from the rule
   (block by block along the reduction dimension: scale = amax / qmax, e4m3 or int8 values, dequantized product
   in fp32) and against ``nn.Linear``.
2. Training: ``zero train`` (Llama 20m, 2 ranks, stage 3, AdamW, the default config) with the same seed and data,
   quantization off (fp32, bf16) and on (bf16 parameters with FP8 / INT8 GEMMs). Runs are kept in
   ``runs/bench-quant/`` and reused by later calls (``--fresh`` re-runs them).

Usage: python benchmarks/bench_quantized.py [--steps 120] [--time-limit 1500] [--only linear,train] [--fresh]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs" / "bench-quant"
TOKENS = 4 * 127  # the main job's micro-batch: 4 windows of 127 next-token positions
SHAPES = {"q/k/v/o_proj": (384, 384), "gate/up_proj": (384, 1024), "down_proj": (1024, 384), "lm_head": (384, 259)}
QMAX = {"fp8": 448.0, "int8": 127.0}
GOAL = 0.02  # the quantized runs' mean loss of the last 10 steps at most 2% above bf16's
VARIANTS = {  # name -> (bf16, quantization dtype or None, block size)
    "fp32": (False, None, None),
    "bf16": (True, None, None),
    "bf16 + FP8, block 128": (True, "fp8", 128),
    "bf16 + INT8, block 128": (True, "int8", 128),
}


def rule(t: torch.Tensor, dim: int, fmt: str, block_size: int) -> torch.Tensor:
    """The rule, one block column at a time (vectorized over the rows): t's dequantized fp32 values."""
    m = (t.float() if dim == 1 else t.float().t()).contiguous()
    out = torch.empty_like(m)
    length = m.shape[1]
    block = length if block_size == 0 or block_size >= length else block_size
    qmax = QMAX[fmt]
    for start in range(0, length, block):
        blk = m[:, start : start + block]
        scale = blk.abs().amax(dim=1, keepdim=True) / qmax
        y = blk / torch.where(scale > 0, scale, torch.ones_like(scale))
        q = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).float() if fmt == "fp8" else y.round().clamp(-qmax, qmax)
        out[:, start : start + block] = q * scale
    return (out if dim == 1 else out.t()).contiguous()


def linear_table() -> str:
    from zero_kernels import GemmQuant, LinearQuantRecipe, SubchannelLinear

    g = torch.Generator().manual_seed(0)
    rows = ["| format, block | max abs difference from the rule (y, dx, dW; all shapes) | relative error vs "
            "nn.Linear, y | dx | dW |", "|---|---|---|---|---|"]  # fmt: skip
    for fmt in ("fp8", "int8"):
        for block in (128, 0):
            spec = GemmQuant(fmt, block)
            worst, rel = 0.0, {"y": 0.0, "dx": 0.0, "dW": 0.0}
            for fin, fout in SHAPES.values():
                lin = torch.nn.Linear(fin, fout, bias=False)
                with torch.no_grad():
                    lin.weight.normal_(0.0, 0.02, generator=g)  # LlamaForCausalLM's initializer_range
                x = torch.randn(TOKENS, fin, generator=g, requires_grad=True)
                dy = torch.randn(TOKENS, fout, generator=g)
                layer = SubchannelLinear(lin, LinearQuantRecipe(spec, spec, spec))
                y = layer(x)
                y.backward(dy)
                got = {"y": y.detach(), "dx": x.grad.clone(), "dW": lin.weight.grad.clone()}
                w = lin.weight.detach()
                ref = {"y": rule(x.detach(), 1, fmt, block) @ rule(w.t(), 0, fmt, block),
                       "dx": rule(dy, 1, fmt, block) @ rule(w, 0, fmt, block),
                       "dW": rule(dy.t(), 1, fmt, block) @ rule(x.detach(), 0, fmt, block)}  # fmt: skip
                exact = {"y": x.detach() @ w.t(), "dx": dy @ w, "dW": dy.t() @ x.detach()}
                for k in got:
                    worst = max(worst, (got[k] - ref[k]).abs().max().item())
                    rel[k] = max(rel[k], ((got[k] - exact[k]).norm() / exact[k].norm()).item())
            name = f"{'FP8 e4m3' if fmt == 'fp8' else 'INT8'}, {'row scaling (0)' if block == 0 else block}"
            rows.append(f"| {name} | {worst:.3g} | {rel['y']:.2%} | {rel['dx']:.2%} | {rel['dW']:.2%} |")
    return "\n".join(rows)


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _run_sampling_load(cmd: list[str], out: Path) -> None:
    """Run ``cmd``; write the 1-minute load average sampled every 15 s meanwhile to ``out`` (the machine is
    shared: the load says how many runnable processes the run's 2 ranks shared 2 cores with)."""
    samples, done = [_load()], threading.Event()

    def sample() -> None:
        while not done.wait(15.0):
            samples.append(_load())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    finally:
        done.set()
        thread.join()
    out.write_text(json.dumps({"load_1min": samples}))


def _run(name: str, bf16: bool, fmt: str | None, block: int | None, steps: int, limit: float, fresh: bool) -> Path:
    from zero.commands.train import DEFAULT_CONFIG

    slug = name.replace(" ", "").replace(",", "-").replace("+", "-").replace("(", "").replace(")", "")
    run = RUNS / f"{slug}-{steps}steps"
    if (run / "summary.json").is_file() and not fresh:
        return run
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    RUNS.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(DEFAULT_CONFIG)
    config["bf16"] = {"enabled": bf16}
    cfg_path = RUNS / f"{slug}.json"
    cfg_path.write_text(json.dumps(config, indent=1))
    cmd = [sys.executable, "-m", "zero.cli", "train", "--config", str(cfg_path), "--steps", str(steps),
           "--runs-dir", str(RUNS), "--name", run.name, "--no-checkpoint", "--eval-every", "0",
           "--time-limit", str(limit)]  # fmt: skip
    if fmt is not None:
        cmd += ["--quantization", fmt, "--quantization-block-size", str(block)]
    print(f"bench quantized: {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    _run_sampling_load(cmd, RUNS / f"{run.name}.load.json")
    return run


def _read(run: Path) -> dict:
    recs = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    load = json.loads((run.parent / f"{run.name}.load.json").read_text())["load_1min"]
    return {"losses": [r["loss"] for r in recs], "load": load, **summary}


def train_table(steps: int, limit: float, fresh: bool) -> str:
    res = {name: _read(_run(name, *v, steps, limit, fresh)) for name, v in VARIANTS.items()}
    common = min(len(r["losses"]) for r in res.values())
    tail = {name: statistics.fmean(r["losses"][common - 10 : common]) for name, r in res.items()}
    rows = [f"| run | steps | loss at step 1 | loss at step {common} | mean loss, steps {common - 9}-{common} | "
            "vs bf16 | vs fp32 | validation loss at the end | vs bf16 | within +2% of bf16 | load average during "
            "the run (1 min; median, max) |", "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in res.items():
        gap = (tail[name] - tail["bf16"]) / tail["bf16"]
        rows.append(f"| {name} | {len(r['losses'])} | {r['losses'][0]:.4f} | {r['losses'][common - 1]:.4f} | "
                    f"{tail[name]:.4f} | {gap:+.2%} | {(tail[name] - tail['fp32']) / tail['fp32']:+.2%} | "
                    f"{r['val_loss_end']:.4f} | {r['val_loss_end'] - res['bf16']['val_loss_end']:+.4f} | "
                    f"{'yes' if gap <= GOAL else 'no'} | "
                    f"{statistics.median(r['load']):.1f}, {max(r['load']):.1f} |")  # fmt: skip
    return "\n".join(rows)


def machine() -> str:
    """The CPU's model, cores and the flags that decide bf16 speed (torch's bf16 matmul uses them on CPU)."""
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "unknown")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), []))
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    lacks = [f for f in ("avx512_bf16", "amx_bf16") if f not in flags]
    return (f"CPU: {model}, {len(__import__('os').sched_getaffinity(0))} cores; flags: {', '.join(have)}"
            f"{'; lacks ' + ', '.join(lacks) if lacks else ''}")  # fmt: skip


def main(argv: list[str] | None = None) -> str:
    """Run the parts asked for; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="20 training steps")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--time-limit", type=float, default=1500.0, help="training seconds per run")
    ap.add_argument("--only", default="linear,train")
    ap.add_argument("--fresh", action="store_true", help="re-run the training runs kept in runs/bench-quant/")
    args = ap.parse_args(argv)
    steps = 20 if args.quick else args.steps
    torch.set_num_threads(1)
    parts = []
    if "linear" in args.only:
        parts += [f"### Quantized Linear vs the rule and vs nn.Linear: Llama 20m Linear shapes ("
                  f"{', '.join(f'{k} {i}x{o}' for k, (i, o) in SHAPES.items())}), {TOKENS} tokens, fp32, x and dy "
                  "~ N(0, 1), W ~ N(0, 0.02)", "", linear_table(), ""]  # fmt: skip
    if "train" in args.only:
        parts += [f"### Main job with the section on and off: `zero train` (Llama 20m, 2 gloo ranks x 1 thread, "
                  f"micro-batch 4 x 128, stage 3, AdamW, WarmupCosineLR), seed 1234, {steps} steps", "",
                  f"{machine()}. Gap: the mean training loss of the last 10 steps against bf16's; stated tolerance: "
                  f"at most +{GOAL:.0%}.", "", train_table(steps, args.time_limit, args.fresh), ""]  # fmt: skip
    parts += [NOTES]
    return "\n".join(parts)


NOTES = """\
The rule (`zero_kernels/subchannel_quant.py`): each GEMM operand cut into `block_size` blocks along the reduction
dimension (forward: input features, dx: output features, dW: tokens; 0: one block per row), fp32 scale = block amax /
448 (e4m3) or / 127 (INT8), values clamp(x / scale) cast to e4m3 or rounded to int8, the GEMM on the dequantized fp32
operands. On CPU every GEMM is this emulation; the `torch._scaled_mm` path for row-scaled FP8 GEMMs on GPUs of compute
capability 8.9+ was not run (no GPU lent). DeepSpeed 0.20 is not on this machine and its stored source predates the
feature: from its tutorial, the `quantization` section, `block_size` (0: row scaling) and the GEMM names forward / dx
/ dw are DeepSpeed's; zero's own choices are the other key names (`enabled`, `dtype`, `module_name_patterns`,
`exclude_module_name_patterns`), the defaults (FP8, block 128, every nn.Linear) and the scale details (no
power-of-two rounding, INT8 symmetric).
"""


if __name__ == "__main__":
    print(main())
