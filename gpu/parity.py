"""GPU check of training parity (run by gpu/run.py): the engine at stages 0-3, with CPU and NVMe optimizer offload
and compiled ZeRO-3 (deepcompile's passes, aot_eager), trained a few steps at world size 1 over NCCL on the GPU,
against the same runs on the CPU.

Run from the repository root on a machine with a CUDA GPU:

    python gpu/parity.py [--steps 4] [--cases stage0,stage3,...]

Each side runs in its own process (a worker: ``--worker cuda`` or ``--worker cpu``; the CPU one with no GPU
visible, over gloo), every case on the same model (zero_compile.testing.TinyTransformer, fp32, seed 0), the same
batches and AdamW. The losses of every step must agree within a relative 1e-3: TF32 is off, so what differs is the
order in which the GPU's and the CPU's kernels sum (each step's loss then moves the next). A case that raises is
recorded with its error and fails; the other cases still run. Prints one row per case; exit status 0 when every
case agrees, 1 otherwise. Without CUDA it prints "no CUDA" and exits 0 (``--device cpu`` compares CPU with CPU:
the comparison's own test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback

RTOL = 1e-3
CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "offload-cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "offload-nvme": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "<tmp>"}},
    "compiled-zero3": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _config(case: str, nvme_path: str) -> dict:
    zero_opt = json.loads(json.dumps(CASES[case]).replace("<tmp>", nvme_path))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero_opt,
        "steps_per_print": 10**9,
    }
    if case == "compiled-zero3":
        # aot_eager: zero_compile's graph passes without inductor's code generation, which would spend most of the
        # time budget compiling on both sides; gpu/compiled_zero3.py runs inductor on the GPU.
        cfg["compile"] = {"deepcompile": True, "backend": "aot_eager", "warmup_steps": 1}
    return cfg


def _train(case: str, device, steps: int) -> list[float]:
    import torch

    import zero
    from zero_compile.testing import TinyTransformer, batches

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyTransformer(d=32).to(device)
    with tempfile.TemporaryDirectory() as nvme:
        engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=_config(case, nvme))
        losses = []
        for step in batches(steps, 1, 1, batch=4, seq=16):
            ids, targets = (t.to(device) for t in step[0][0])
            loss = engine(ids, targets)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        engine.destroy()
    return losses


def worker(device_name: str, cases: list[str], steps: int) -> dict:
    """Every case on one device in this process: case -> {"losses": [...]} or {"error": traceback}."""
    import torch
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(device_name)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    for case in cases:
        try:
            out[case] = {"losses": _train(case, device, steps)}
        except Exception:  # recorded, and the next case still runs
            out[case] = {"error": traceback.format_exc(limit=8)}
    dist.destroy_process_group()
    return out


def _run_worker(device: str, cases: list[str], steps: int) -> dict:
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the reference sees no GPU at all
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        args = [sys.executable, __file__, "--worker", device, "--cases", ",".join(cases), "--steps", str(steps)]
        proc = subprocess.run([*args, "--out", out], env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = (proc.stdout + proc.stderr)[-3000:]
            return {c: {"error": f"the {device} worker exited with {proc.returncode}:\n{tail}"} for c in cases}
        with open(out) as f:
            return json.load(f)


def compare(got: dict, ref: dict, rtol: float = RTOL) -> list[tuple[str, bool, str]]:
    """(case, agrees, what was seen) per case of ``ref``."""
    rows = []
    for case in ref:
        a, b = got.get(case, {"error": "not run"}), ref[case]
        if "error" in a or "error" in b:
            err = a.get("error") or b.get("error")
            rows.append((case, False, "error: " + err.strip().splitlines()[-1]))
            continue
        la, lb = a["losses"], b["losses"]
        worst = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(la, lb)), default=float("inf"))
        ok = len(la) == len(lb) > 0 and worst <= rtol
        seen = f"losses {', '.join(f'{x:.5f}' for x in la)} vs {', '.join(f'{y:.5f}' for y in lb)}; max rel {worst:.1e}"
        rows.append((case, ok, seen))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cuda", help="the side checked against the CPU (cpu: the check's own test)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    if args.worker:
        result = worker(args.worker, cases, args.steps)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing to check")
        return 0
    got = _run_worker(args.device, cases, args.steps)
    ref = _run_worker("cpu", cases, args.steps)
    rows = compare(got, ref)
    print(f"parity: {args.device} (world 1, {'NCCL' if args.device == 'cuda' else 'gloo'}) vs cpu (gloo), "
          f"{args.steps} steps, fp32, losses within rel {RTOL:g}")  # fmt: skip
    print("| case | agrees | seen |\n|---|---|---|")
    for case, ok, seen in rows:
        print(f"| {case} | {'yes' if ok else 'NO'} | {seen} |")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
