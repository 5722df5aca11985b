"""GPU check of model capacity (run by gpu/run.py): the largest Llama-shaped model that trains a step at world
size 1 with the optimizer offloaded to the CPU (ZeRO-Offload, stage 2) and with the parameters offloaded too
(stage 3, ZeRO-Infinity's CPU tier), zero against DeepSpeed 0.19.8, in parameters and tokens/s.

Run from the repository root on a machine with a CUDA GPU:

    python gpu/capacity.py [--peers zero,deepspeed] [--modes optimizer,param] [--budget SECONDS]
    python gpu/capacity.py --device cpu --start 1      # the machinery on the CPU, tiny ladder

The models climb a fixed ladder (:data:`LADDER`, hidden size and layers growing together, 0.8B to 65B
parameters, Llama's proportions). Each (mode, peer) pair searches it on its own: the first rung tried is the largest
one the host and GPU memory should hold (:func:`predict_start`; the same rung for both peers, so their tokens/s
compare at one size), then one rung up after a fit, down (1, 2, 4 rungs) after a failure, and by bisection once
both a fit and a failure are known. The pairs take turns, one trial each, until each search is settled or the time
(``--budget``, default $ZERO_GPU_CHECK_SECONDS from gpu/run.py, else 600 s) would not cover its next trial
(estimated from the last trial, scaled by the parameter count).

A trial is a process of its own (``--trial``): the model built in bf16 on the GPU, the peer's engine with the
mode's config (gpu/peer_configs.py: AdamW, clipping 1.0, pinned host memory), two steps of ``TOKENS``
(micro-batch x sequence length); tokens/s from the second. It fits when both steps finish. It does not fit when
CUDA or the host runs out of memory: a CUDA out-of-memory error, the host's available memory falling under
``HOST_FLOOR`` (the parent then kills the trial), or the kernel's OOM killer (the trial asks to be its first
choice). Any other error is reported as an error and ends that search. Exit status 1 when a trial erred, else 0.
Without CUDA (and no ``--device cpu``) it prints "no CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import peer_configs as pc

LADDER = tuple(pc.Shape.llama(h, n) for h, n in ((2048, 16), (2048, 24), (2560, 24), (3072, 24), (3072, 32),
                                                 (4096, 24), (4096, 32), (4096, 40), (5120, 40), (6144, 48),
                                                 (8192, 48), (8192, 80)))  # fmt: skip
CPU_LADDER = tuple(pc.Shape.llama(h, n) for h, n in ((128, 2), (256, 2), (256, 4), (384, 4)))
MODES = {
    "optimizer": pc.Setup("optimizer-offload", 2, offload_optimizer="cpu"),
    "param": pc.Setup("param-offload", 3, offload_optimizer="cpu", offload_param=True),
}
# What each mode needs per parameter (bytes), for the first rung tried: on the host the fp32 master weights, the two
# AdamW moments and the fp32 gradient (and the bf16 parameters with parameter offload); on the GPU the bf16
# parameters and gradients at stage 2 (stage 3 with parameter offload holds a few layers at a time).
HOST_BYTES_PER_PARAM = {"optimizer": 16, "param": 18}
GPU_BYTES_PER_PARAM = {"optimizer": 4, "param": 0}
TOKENS = {"cuda": (2, 1024), "cpu": (1, 64)}  # micro-batch x sequence length of a step, per device
HOST_FLOOR = 3 * 2**30  # bytes of available host memory under which a trial is killed
FIRST_TRIAL_S = {"cuda": 60.0, "cpu": 20.0}  # a first trial's assumed seconds, before one was timed


def predict_start(ladder: tuple[pc.Shape, ...], mode: str, host_available: int, gpu_total: int | None) -> int:
    """Index of the largest rung whose parameters times the mode's bytes per parameter fit 85% of the host's
    available memory and 80% of the GPU's (``gpu_total`` None: the GPU is not counted); 0 when none does."""
    best = 0
    for i, shape in enumerate(ladder):
        n = shape.params()
        host_ok = n * HOST_BYTES_PER_PARAM[mode] <= 0.85 * host_available
        gpu_ok = gpu_total is None or n * GPU_BYTES_PER_PARAM[mode] <= 0.8 * gpu_total
        if host_ok and gpu_ok:
            best = i
    return best


class LadderSearch:
    """The largest rung of a ladder of ``n`` rungs that fits, searched from ``start`` (see the module docstring).
    ``next()`` says which rung to try (None when settled or stopped); ``record(i, fits)`` takes the outcome."""

    def __init__(self, n: int, start: int):
        self.n = n
        self.start = start
        self.lo = -1  # the largest rung known to fit (-1: none yet)
        self.hi = n  # the smallest rung known not to fit (n: none yet)
        self.down = 1  # how far the next step down goes while nothing fits
        self.tried = False
        self.stopped: str | None = None  # why the search ended early (time, an error)

    def next(self) -> int | None:
        if self.stopped:
            return None
        if not self.tried:
            return self.start
        if self.lo + 1 >= self.hi:
            return None
        if self.hi == self.n:
            return self.lo + 1
        if self.lo == -1:
            return max(self.hi - self.down, 0)
        return (self.lo + self.hi) // 2

    def record(self, i: int, fits: bool) -> None:
        if fits:
            self.lo = max(self.lo, i)
        else:
            self.hi = min(self.hi, i)
            if self.lo == -1 and self.tried:
                self.down *= 2  # still nothing fits: the next step down goes twice as far
        self.tried = True

    def stop(self, why: str) -> None:
        self.stopped = why

    @property
    def largest(self) -> int | None:
        return self.lo if self.lo >= 0 else None


@dataclasses.dataclass
class Trial:
    """One trial's outcome: status is "fits", "does not fit", "error" or "timed out"."""

    key: tuple[str, str]  # (mode, peer)
    rung: int
    params: int
    status: str
    seconds: float
    why: str = ""
    init_s: float | None = None
    step_s: list[float] = dataclasses.field(default_factory=list)
    tokens_per_s: float | None = None
    peak_gpu_bytes: int | None = None
    peak_host_bytes: int | None = None


def searches_for(keys: list[tuple[str, str]], starts: dict[str, int], rungs: int) -> dict:
    """One :class:`LadderSearch` per ``(mode, peer)`` key, from its mode's start rung, in the keys' order."""
    return {k: LadderSearch(rungs, starts[k[0]]) for k in keys}


def run_searches(searches: dict[tuple[str, str], LadderSearch], ladder: tuple[pc.Shape, ...],
                 trial: Callable[[tuple[str, str], int, float], Trial], left: Callable[[], float],
                 first_trial_s: float, done: list[Trial], log: Callable[[Trial], None] = lambda t: None
                 ) -> None:  # fmt: skip
    """Run the searches, the keys taking turns, one trial each, appending every trial to ``done``;
    ``trial(key, rung, timeout)`` runs one; ``left()`` is the seconds left. A key's next trial is not started when
    its estimate (its last trial's seconds, or the last trial's of any key, times the parameter ratio; else
    ``first_trial_s``) exceeds what is left."""
    last: dict[tuple[str, str], Trial] = {}
    while True:
        active = [k for k, s in searches.items() if s.next() is not None]
        if not active:
            return
        for k in active:
            s = searches[k]
            i = s.next()
            if i is None:
                continue
            prev = last.get(k) or (done[-1] if done else None)  # its own last trial, else the last of any
            estimate = prev.seconds * ladder[i].params() / prev.params if prev else first_trial_s
            if estimate > left():
                s.stop(f"not tried: the time left ({max(left(), 0):.0f} s) is under the estimate ({estimate:.0f} s)")
                continue
            t = trial(k, i, left())
            done.append(t)
            last[k] = t
            log(t)
            if t.status in ("fits", "does not fit"):
                s.record(i, t.status == "fits")
            else:
                s.stop(f"{t.status} at rung {i}: {t.why}")


def meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes (0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def is_out_of_memory(e: BaseException) -> bool:
    """A CUDA or host allocation failure (torch's OutOfMemoryError, MemoryError, the messages CUDA and pinned host
    allocations fail with)."""
    import torch

    if isinstance(e, torch.OutOfMemoryError | MemoryError):
        return True
    text = str(e).lower()
    return any(s in text for s in ("out of memory", "cudaerrormemoryallocation", "cannot allocate memory"))


def run_trial(peer: str, mode: str, rung: int, device: str, ladder_name: str, out: Path) -> None:
    """The ``--trial`` process: one model, one engine, two steps; writes its Trial fields as JSON to ``out``."""
    with contextlib.suppress(OSError):  # the kernel's OOM killer takes this process first
        Path("/proc/self/oom_score_adj").write_text("1000")
    import peer_workers as pw
    import torch

    ladder = LADDER if ladder_name == "gpu" else CPU_LADDER
    shape = ladder[rung]
    micro, seq = TOKENS[device]
    result: dict = {"params": shape.params()}
    try:
        pw.start_process_group(peer, device)
        t0 = time.perf_counter()
        model = pw.build_model(shape, seq, device, dtype=torch.bfloat16)
        wrapped = pw.wrap(peer, MODES[mode], model, micro, device)
        del model
        pw.sync(device)
        result["init_s"] = time.perf_counter() - t0
        steps = []
        for batch in pw.batches(2, micro, seq, device):
            pw.sync(device)
            t0 = time.perf_counter()
            loss = float(wrapped.step(batch).detach().float())
            pw.sync(device)
            steps.append(time.perf_counter() - t0)
        result.update(status="fits", step_s=steps, tokens_per_s=micro * seq / steps[-1], why=f"loss {loss:.3f}",
                      peak_gpu_bytes=torch.cuda.max_memory_reserved() if device == "cuda" else None)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the outcome of the trial, reported to the parent
        lines = traceback.format_exc().strip().splitlines()
        if is_out_of_memory(e):
            result.update(status="does not fit", why=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")
        else:
            result.update(status="error", why=" / ".join(lines[-3:])[:600])
            print("\n".join(lines), file=sys.stderr)
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    hwm = next((int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmHWM:")), None)
    result["peak_host_bytes"] = hwm
    out.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: freeing tens of GB of pinned memory takes seconds the next trial can use


def spawn_trial(key: tuple[str, str], rung: int, timeout: float, device: str, ladder_name: str,
                params: int) -> Trial:  # fmt: skip
    """Run one trial process, killing it (its whole process group) when the host's available memory falls under
    HOST_FLOOR or ``timeout`` passes."""
    mode, peer = key
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trial.json"
        env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   DS_ACCELERATOR="cuda" if device == "cuda" else "cpu")  # fmt: skip
        cmd = [sys.executable, __file__, "--trial", peer, mode, str(rung), "--device", device, "--ladder", ladder_name,
               "--out", str(out)]  # fmt: skip
        t0 = time.monotonic()
        log = open(Path(tmp) / "log.txt", "w+")  # noqa: SIM115 - read back below
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)  # fmt: skip
        killed = ""
        lowest = meminfo("MemAvailable")
        while proc.poll() is None:
            avail = meminfo("MemAvailable")
            lowest = min(lowest, avail) if avail else lowest
            if avail and avail < HOST_FLOOR:
                killed = f"host memory: {avail / 2**30:.1f} GiB available, under the {HOST_FLOOR / 2**30:.0f} GiB floor"
            elif time.monotonic() - t0 > timeout:
                killed = f"no result in {timeout:.0f} s"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.05)
        seconds = time.monotonic() - t0
        log.seek(0)
        tail = log.read()[-2000:]
        log.close()
        if out.exists() and not killed:
            got = json.loads(out.read_text())
            status, why = got.pop("status"), got.pop("why", "")
            got.pop("params", None)
            return Trial(key, rung, params, status, seconds, why, **got)
        if killed.startswith("host memory"):
            return Trial(key, rung, params, "does not fit", seconds, killed)
        if killed:
            return Trial(key, rung, params, "timed out", seconds, killed)
        if proc.returncode == -signal.SIGKILL:
            return Trial(key, rung, params, "does not fit", seconds,
                         f"killed by the kernel (SIGKILL; lowest available host memory seen "
                         f"{lowest / 2**30:.1f} GiB): the OOM killer")  # fmt: skip
        return Trial(key, rung, params, "error", seconds, f"exit {proc.returncode}: {tail.strip()[-600:]}")


def _die_with_parent() -> None:
    """In a trial's process before it runs: SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), so a capacity
    check stopped at its limit leaves no trial holding the host's memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _b(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def summary(searches: dict[tuple[str, str], LadderSearch], trials: list[Trial], ladder) -> list[str]:
    """The capacity table (one row per mode and peer) and, per mode, tokens/s at the largest rung every peer fit."""
    lines = ["| mode | peer | largest that trained | shape (hidden x layers) | tokens/s | step s | init s | "
             "peak GPU GiB | peak host GiB | next rung up |", "|" + "---|" * 10]  # fmt: skip
    for (mode, peer), s in searches.items():
        best = s.largest
        t = next((t for t in trials if t.key == (mode, peer) and t.rung == best and t.status == "fits"), None)
        up = "-" if best is not None and best + 1 >= len(ladder) else None
        above = (best + 1) if best is not None else s.start
        failed = next((t for t in trials if t.key == (mode, peer) and t.rung == above and t.status != "fits"), None)
        up = up or (f"{_b(ladder[above].params())}: {failed.status} ({failed.why})" if failed else
                    (s.stopped or "not tried"))  # fmt: skip
        if t is None:
            lines.append(f"| {mode} | {peer} | none | - | - | - | - | - | - | {up} |")
            continue
        shape = ladder[best]
        lines.append(f"| {mode} | {peer} | {_b(t.params)} | {shape.hidden} x {shape.layers} | "
                     f"{t.tokens_per_s:.0f} | {t.step_s[-1]:.2f} | {t.init_s:.1f} | {_gib(t.peak_gpu_bytes)} | "
                     f"{_gib(t.peak_host_bytes)} | {up} |")  # fmt: skip
    for mode in dict.fromkeys(m for m, _ in searches):
        fits = {}
        for t in trials:
            if t.key[0] == mode and t.status == "fits":
                fits.setdefault(t.rung, {})[t.key[1]] = t
        common = [r for r, by in fits.items() if {"zero", "deepspeed"} <= set(by)]
        if common:
            r = max(common)
            z, d = fits[r]["zero"], fits[r]["deepspeed"]
            lines.append(f"\n{mode} offload, both at {_b(z.params)}: zero {z.tokens_per_s:.0f} tokens/s, DeepSpeed "
                         f"{d.tokens_per_s:.0f} tokens/s: zero/DeepSpeed step time "
                         f"{z.step_s[-1] / d.step_s[-1]:.2f}x")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--peers", default="zero,deepspeed")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--start", type=int, help="first rung tried (default: predicted from the memory)")
    ap.add_argument("--ladder", choices=["gpu", "cpu"], help="default: gpu on cuda, cpu on the CPU")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("ZERO_GPU_CHECK_SECONDS", 600)))
    ap.add_argument("--json", type=Path, help="write every trial as JSON here")
    ap.add_argument("--trial", nargs=3, metavar=("PEER", "MODE", "RUNG"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ladder_name = args.ladder or ("gpu" if args.device == "cuda" else "cpu")
    if args.trial:
        peer, mode, rung = args.trial
        run_trial(peer, mode, int(rung), args.device, ladder_name, args.out)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing to measure here (run on a machine with a GPU, or --device cpu)")
        return 0
    deadline = time.monotonic() + args.budget - 10  # the table is printed before the limit
    ladder = LADDER if ladder_name == "gpu" else CPU_LADDER
    host = meminfo("MemAvailable")
    gpu = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else None
    modes, peers = args.modes.split(","), args.peers.split(",")
    starts = {m: args.start if args.start is not None else predict_start(ladder, m, host, gpu) for m in modes}
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    micro, seq = TOKENS[args.device]
    print(f"capacity: {where} ({_gib(gpu)} GiB), host {_gib(meminfo('MemTotal'))} GiB ({_gib(host)} GiB available), "
          f"{os.cpu_count()} CPU cores; {micro} x {seq} tokens a step, bf16, AdamW; first rungs "
          + ", ".join(f"{m} {_b(ladder[i].params())}" for m, i in starts.items()), flush=True)  # fmt: skip

    import peer_ops

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if args.device == "cuda" else "cpu")
    t0 = time.monotonic()
    ops = {p: peer_ops.preload(p, args.device, only=("cpu_adam",)) for p in peers}  # the offloaded step's op
    print(f"capacity: JIT ops loaded or built in {time.monotonic() - t0:.1f} s, apart from the trials: {ops}",
          flush=True)  # fmt: skip

    def trial(key, rung, timeout):
        return spawn_trial(key, rung, timeout, args.device, ladder_name, ladder[rung].params())

    def log(t: Trial) -> None:
        rate = f", {t.tokens_per_s:.0f} tokens/s" if t.tokens_per_s else ""
        print(f"capacity: {t.key[0]} {t.key[1]} {_b(t.params)}: {t.status}{rate} ({t.seconds:.0f} s) {t.why}",
              flush=True)  # fmt: skip

    searches = searches_for([(m, p) for m in modes for p in peers], starts, len(ladder))
    trials: list[Trial] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # gpu/run.py's limit: the table is still printed
    try:
        run_searches(searches, ladder, trial, lambda: deadline - time.monotonic(), FIRST_TRIAL_S[args.device], trials,
                     log)  # fmt: skip
    finally:
        print()
        print("\n".join(summary(searches, trials, ladder)), flush=True)
        if args.json:
            args.json.write_text(json.dumps([dataclasses.asdict(t) for t in trials], indent=1))
    return 1 if any(t.status == "error" for t in trials) else 0


if __name__ == "__main__":
    sys.exit(main())
