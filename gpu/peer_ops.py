"""The peers' just-in-time op builds, timed apart from their training steps (the ``peer-ops`` check of gpu/run.py,
and :func:`preload` in each peer's worker).

    python gpu/peer_ops.py [--device cuda|cpu]   # build every op below, each in its own process, at once

DeepSpeed builds its C++/CUDA ops with ninja on first use (``op_builder``): CPUAdam (the offloaded optimizer step,
ZeRO-Offload, SuperOffload, parameter offload), FusedAdam (the optimizer step on the GPU) and DeepCompile's runtime
(``dc``, CUDA only). zero builds zero-kernels' CPU Adam (its CUDA ops are the ``cuda-ops`` check's). The builds go
to ``$TORCH_EXTENSIONS_DIR`` (DeepSpeed; gpu/run.py sets one folder for the whole run) and ``$ZERO_KERNELS_CACHE``
(zero), so a later process only loads them. DeepSpeed's build lock is a plain file that a killed build leaves
behind and every later build then waits on for ever: :func:`clear_stale_locks` removes those before building (no
other build of these ops runs meanwhile in gpu/run.py). Prints one row per op with its seconds; exit status 1 when
an op failed to build. Without CUDA (and no ``--device cpu``) it prints "no CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

# op name -> DeepSpeed builder class, per device; DeepCompile's op needs CUDA.
DEEPSPEED_OPS = {
    "cuda": {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder", "dc": "DeepCompileBuilder"},
    "cpu": {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder"},
}
ZERO_OPS = ("cpu_adam",)


def ops_of(peer: str, device: str) -> tuple[str, ...]:
    """The ops ``peer`` builds just in time on ``device`` (FSDP2: none)."""
    if peer == "deepspeed":
        return tuple(DEEPSPEED_OPS[device])
    return ZERO_OPS if peer == "zero" else ()


def extensions_dir() -> Path:
    """Where torch's JIT builds (DeepSpeed's ops) go: ``$TORCH_EXTENSIONS_DIR``, else torch's default root."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("x", verbose=False)).parent


def clear_stale_locks(root: Path) -> list[Path]:
    """Remove the ``lock`` file of every op folder under ``root`` (what a killed build leaves); returns them."""
    found = sorted(root.glob("*/lock")) if root.is_dir() else []
    for lock in found:
        lock.unlink(missing_ok=True)
    return found


def build_one(peer: str, op: str, device: str) -> float:
    """Load ``peer``'s ``op``, building it if it is not in the cache; the seconds it took."""
    t0 = time.perf_counter()
    if peer == "deepspeed":
        from deepspeed.accelerator import get_accelerator

        get_accelerator().create_op_builder(DEEPSPEED_OPS[device][op]).load(verbose=False)
    else:
        from zero_kernels import loader

        loader.load(op)
    return time.perf_counter() - t0


def preload(peer: str, device: str, only: tuple[str, ...] | None = None) -> dict[str, str]:
    """Before any step: every op of ``peer`` (or those of them in ``only``) loaded, built if missing,
    ``{op: "1.2 s"}``, or the error's last line (what needs the op then fails with the whole error)."""
    if peer == "deepspeed":
        clear_stale_locks(extensions_dir())  # one DeepSpeed process at a time loads: any lock is a killed build's
    out = {}
    for op in ops_of(peer, device):
        if only is not None and op not in only:
            continue
        try:
            out[op] = f"{build_one(peer, op, device):.1f} s"
        except Exception as e:  # noqa: BLE001 - reported, and raised again where the op is used
            out[op] = f"failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--peers", default="zero,deepspeed")
    ap.add_argument("--one", nargs=2, metavar=("PEER", "OP"), help="build one op in this process (internal)")
    args = ap.parse_args(argv)
    if args.one:
        try:
            print(f"{build_one(*args.one, args.device):.1f}")
            return 0
        except Exception:  # noqa: BLE001 - the parent prints it
            traceback.print_exc()
            return 1
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing to build here (run on a machine with a GPU, or --device cpu)")
        return 0
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    removed = clear_stale_locks(extensions_dir())
    if removed:
        print(f"removed {len(removed)} stale build lock(s): {', '.join(str(p) for p in removed)}")
    print(f"TORCH_EXTENSIONS_DIR={extensions_dir()}, {os.cpu_count()} CPU cores; every op built at once")
    t0 = time.perf_counter()
    jobs = {}
    for peer in args.peers.split(","):
        for op in ops_of(peer, args.device):
            cmd = [sys.executable, __file__, "--device", args.device, "--one", peer, op]
            jobs[(peer, op)] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = 0
    print("| peer | op | seconds (load or build) |\n|---|---|---|")
    for (peer, op), proc in jobs.items():
        out, _ = proc.communicate()
        if proc.returncode == 0:
            print(f"| {peer} | {op} | {out.strip().splitlines()[-1]} |")
        else:
            failed += 1
            print(f"| {peer} | {op} | FAILED |\n```\n{out[-4000:]}\n```")
    print(f"all builds: {time.perf_counter() - t0:.1f} s wall")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
