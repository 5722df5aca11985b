"""MoE expert parallelism on 2 and 4 gloo ranks (moe_worker.py): a tiny Mixtral-style model whose MoE blocks are
``deepspeed.moe.layer.MoE``, trained by zero with ``ep_size`` = world (ZeRO-2), by DeepSpeed 0.19.8 with the same
(its own MoE layer, gloo) and by zero without expert parallelism (``ep_size`` 1, ZeRO-3, each MoE layer a leaf
module). Median step time over interleaved rounds (every second round reversed, each launch's first step dropped),
with the 1-minute load average (``os.getloadavg``, as ``uptime`` prints it) at each launch beside it; all-to-all
bytes per step against their formula; model-state bytes per rank against their formula.

Usage: python benchmarks/bench_moe.py [--quick] [--rounds N] [--worlds 2,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_worker import EXPERTS, FFN, HIDDEN, LAYERS, MICRO, SEQ

HERE = Path(__file__).resolve().parent
ORDER = [("deepspeed", "ep"), ("zero", "ep"), ("zero", "leaf")]


def launch(impl: str, mode: str, world: int, steps: int, out: Path) -> dict | str:
    """One torchrun launch; rank 0's result with the load average at launch, or the error text."""
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), str(HERE / "moe_worker.py"),
           "--impl", impl, "--mode", mode, "--ep", str(world), "--steps", str(steps), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "stderr.txt").write_text(proc.stderr)
        lines = proc.stderr.splitlines()
        lines = [ln for ln in lines if ln.startswith("[rank") and "Error" in ln] or lines or ["failed"]
        return f"exit {proc.returncode}: {lines[-1][:200]} (stderr: {out / 'stderr.txt'})"
    res = json.loads((out / "rank0.json").read_text())
    res["load"] = load
    return res


def alltoall_formula(world: int) -> float:
    """Bytes one rank sends to the others per step: per MoE layer, 4 exchanges (dispatch and combine, forward and
    backward) of its [E, C, hidden] fp32 buffer, (P - 1) / P of it to other ranks; C = ceil(S / E * 2) for top-2
    with capacity_factor 1 (S tokens per rank)."""
    s = MICRO * SEQ
    capacity = max(-(-2 * s // EXPERTS), 4)
    return LAYERS * 4 * EXPERTS * capacity * HIDDEN * 4 * (world - 1) / world


def state_formula(impl: str, mode: str, world: int, res: dict) -> float:
    """Model-state bytes per rank, fp32 with Adam (4 bytes a parameter, 4 a gradient, 8 the moments, 4 DeepSpeed's
    separate fp32 master). ``ep``: a rank holds psi_r = psi_s shared + psi_l local expert elements whole; zero
    shards gradients and moments of both over the W / P expert-data-parallel ranks: 4 psi_r + 12 psi_r / (W / P);
    DeepSpeed shards the shared ones over all W ranks: 4 psi_r + 16 (psi_s / W + psi_l / (W / P)). ``leaf``: ZeRO-3
    over W, the ZeRO paper's 16 psi / W."""
    psi_s, psi_l = res["shared_params"], res["local_expert_params"]
    psi_r = psi_s + psi_l
    if mode == "leaf":
        return 16 * psi_r / world
    edp = world // res["ep"]
    if impl == "deepspeed":
        return 4 * psi_r + 16 * (psi_s / world + psi_l / edp)
    return 4 * psi_r + 12 * psi_r / edp


def main(argv: list[str] | None = None) -> str:
    """Run the comparison; return the markdown section."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps, one round unless --rounds")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    ap.add_argument("--worlds", default="2,4")
    args = ap.parse_args(argv)
    steps = 4 if args.quick else 6
    rounds = args.rounds or (1 if args.quick else 2)
    workdir = Path(tempfile.mkdtemp(prefix="zero-bench-moe-"))
    rows = ["| ranks | configuration | median s/step (load avg at launches) | vs DeepSpeed ep | vs zero leaf "
            "| all-to-all bytes/step/rank | formula | model-state MiB/rank: params + grads + master + optimizer "
            "= total | formula MiB | measured/formula | first losses |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for world in [int(w) for w in args.worlds.split(",")]:
        runs: dict = {key: [] for key in ORDER}
        for rnd in range(rounds):
            for impl, mode in ORDER if rnd % 2 == 0 else ORDER[::-1]:
                print(f"bench moe: world {world} round {rnd + 1} {impl} {mode}", file=sys.stderr, flush=True)
                out = workdir / f"w{world}-{impl}-{mode}-{rnd}"
                runs[(impl, mode)].append(launch(impl, mode, world, steps, out))
        ok = {k: v for k, v in runs.items() if all(isinstance(r, dict) for r in v)}

        def step(key, ok=ok):
            return statistics.median([t for r in ok[key] for t in r["step_s"][1:]])

        for key in ORDER:
            name = f"{'DeepSpeed' if key[0] == 'deepspeed' else 'zero'} " + (
                f"ep={world}, ZeRO-2" if key[1] == "ep" else "ep=1, ZeRO-3, MoE as leaf module"
            )
            if key not in ok:
                rows.append(f"| {world} | {name} | failed: {next(r for r in runs[key] if isinstance(r, str))} |"
                            + " |" * 8)  # fmt: skip
                continue
            r = ok[key][0]
            vs = [f"{step(key) / step(p):.2f}x" if p in ok else "" for p in (("deepspeed", "ep"), ("zero", "leaf"))]
            loads = ", ".join(f"{x['load']:.2f}" for x in ok[key])
            sent = statistics.median(r["sent_bytes"])
            a2a = alltoall_formula(world) if key[1] == "ep" else 0
            s = r["model_state_bytes"]
            parts = " + ".join(f"{s[k] / 2**20:.2f}" for k in ("params", "grads", "master", "optimizer"))
            formula = state_formula(*key, world, r)
            rows.append(f"| {world} | {name} | {step(key):.4f} ({loads}) | {vs[0]} | {vs[1]} | {sent:.0f} | {a2a:.0f} "
                        f"| {parts} = {s['total'] / 2**20:.2f} | {formula / 2**20:.2f} | {s['total'] / formula:.3f} "
                        f"| {', '.join(f'{x:.4f}' for x in r['losses'][:3])} |")  # fmt: skip
    head = (f"Tiny Mixtral-style model: {LAYERS} blocks of LayerNorm + Linear + `MoE(hidden={HIDDEN}, SwiGLU expert "
            f"ffn={FFN}, num_experts={EXPERTS}, k=2, capacity_factor=1.0, drop_tokens=True, use_rts=False)`, vocab "
            f"512; {MICRO} x {SEQ} tokens per rank per step; fp32, torch AdamW (lr 1e-3), gloo, 1 thread per rank. "
            "ep runs: `ep_size` = ranks (each rank holds 1/ranks of the experts), ZeRO-2 for both implementations "
            "(DeepSpeed 0.19.8's own MoE layer). leaf: zero, `ep_size` 1 at ZeRO-3 with `set_z3_leaf_modules` (every "
            f"rank computes every expert). Median over {rounds} interleaved round(s) of {steps} steps, each launch's "
            "first dropped; the 1-minute load average at each launch in brackets (the machine is shared). "
            "All-to-all bytes: what one rank sends to the others per step (counted around the all-to-all call). "
            "Model state: zero's runtime accounting; DeepSpeed: module parameters, gradients held after backward, "
            "its fp32 master partitions and the inner optimizer's state. Formulas: `alltoall_formula` and "
            "`state_formula` in `benchmarks/bench_moe.py` (padding not included); zero's stage-3 `params` "
            "figure measures 4 psi / W + 4 psi here (a whole-model-sized buffer besides the shards; not examined "
            "further), hence the "
            "leaf rows' measured/formula of 1 + W / 4.\n")  # fmt: skip
    return head + "\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(main(sys.argv[1:]))
