"""GPU check of zero against its peers (run by gpu/run.py): the same training steps by zero, DeepSpeed 0.19.8 and
PyTorch FSDP2 at world size 1, interleaved, as ratios.

Run from the repository root on a machine with a CUDA GPU (DeepSpeed installed, or carried in the wheelhouse):

    python gpu/peers.py [--setups stage2,stage3,...] [--peers zero,deepspeed,fsdp2] [--rounds 3] [--json PATH]
    python gpu/peers.py --device cpu --setups stage3   # the machinery on the CPU, tiny model (no GPU needed)

Configurations, model and what each peer is given: gpu/peer_configs.py (stage 2, stage 3, ZeRO-Offload,
SuperOffload, parameter offload, compiled ZeRO-3; a ~410M-parameter Llama, bf16, AdamW, clipping at 1.0). Each peer
runs in a process of its own (gpu/peer_workers.py), started once and kept across configurations, so that the three
models sit on the GPU together and their steps interleave: per configuration every peer sets up, runs its warm-up
steps (untimed), then ``--rounds`` rounds of ``--steps`` steps each, peer after peer, the order rotated every
round (zero, DeepSpeed, FSDP2; then DeepSpeed, FSDP2, zero; ...), so a drift of the machine falls on all alike.
A step is timed from one device synchronisation to the next. Reported per configuration: each peer's median
step, zero / DeepSpeed and zero / FSDP2, and each peer's largest relative loss difference from zero's over the same
batches. The JIT op builds are made before any step and reported apart (gpu/peer_ops.py).

A peer that fails is recorded in its cell with the error's last line, and its process is replaced before the next
configuration; so is one that still holds more than LEFT_BYTES of device memory after closing a configuration. The
check stops starting configurations when its time (``--budget`` seconds, default $ZERO_GPU_CHECK_SECONDS from
gpu/run.py, else 600) would not cover one, and says which were not run. Exit status 0 when every peer ran every
configuration it has and the losses agree within LOSS_RTOL, 1 otherwise. Without CUDA (and no ``--device cpu``) it
prints "no CUDA" and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import re
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

import peer_configs as pc

# bf16 forward in every peer, but their kernels (fused Adam variants, reduction order, rotary buffers kept in fp32
# or not) differ: the losses of the same batches agree to about 1e-3, not bitwise.
LOSS_RTOL = 2e-2
LEFT_BYTES = 2**30  # device memory a peer may still hold after closing a configuration before it is restarted
SETUP_WAIT_S = 420  # longest wait for a peer's setup or warm-up (DeepCompile's and inductor's first compilation)


def round_orders(peers: list[str], rounds: int) -> list[list[str]]:
    """The order peers run in each round: the list rotated by one each round."""
    n = len(peers)
    return [[peers[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else [[] for _ in range(rounds)]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def max_rel_diff(losses: list[float], ref: list[float]) -> float | None:
    """Largest ``|a - b| / |b|`` over the steps both ran; None without a common step."""
    pairs = list(zip(losses, ref))
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs) if pairs else None


@dataclasses.dataclass
class Cell:
    """One peer in one configuration: its timed steps and losses (all steps, warm-up included), or its error."""

    times: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    setup_s: float | None = None
    peak_device_bytes: int | None = None
    error: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.times) if self.times and not self.error else None


def row(setup: pc.Setup, cells: dict[str, Cell], peers: list[str]) -> dict:
    """One configuration's results: medians (s), the ratios, each peer's loss agreement with zero, errors."""
    med = {p: cells[p].median if p in cells else None for p in peers}
    ref = cells["zero"].losses if "zero" in cells and not cells["zero"].error else []
    agree = {p: max_rel_diff(cells[p].losses, ref) for p in peers if p != "zero" and p in cells and ref}
    return {
        "setup": setup.name,
        "median_s": med,
        "zero/deepspeed": ratio(med.get("zero"), med.get("deepspeed")),
        "zero/fsdp2": ratio(med.get("zero"), med.get("fsdp2")),
        "loss_rel_diff": agree,
        "losses": {p: c.losses for p, c in cells.items()},
        "times": {p: c.times for p, c in cells.items()},
        "setup_s": {p: c.setup_s for p, c in cells.items()},
        "peak_device_bytes": {p: c.peak_device_bytes for p, c in cells.items()},
        "errors": {p: c.error for p, c in cells.items() if c.error},
        "absent": {p: setup.fsdp2_missing for p in peers if p not in cells and not pc.runs(setup, p)},
    }


def passed(r: dict) -> bool:
    """No peer failed and every loss agrees with zero's within LOSS_RTOL."""
    return not r["errors"] and all(d is not None and d <= LOSS_RTOL for d in r["loss_rel_diff"].values())


def _fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: list[dict], peers: list[str]) -> list[str]:
    """The Markdown table of ``rows`` (one per configuration)."""
    head = ["configuration", *(f"{p} ms" for p in peers), "zero/DeepSpeed", "zero/FSDP2", "loss rel. diff from zero"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for p in peers:
            err = r["errors"].get(p)
            cells.append("error" if err else "n/a" if p in r["absent"] else _fmt_ms(r["median_s"].get(p)))
        agree = ", ".join(f"{p} {d:.1e}" for p, d in r["loss_rel_diff"].items() if d is not None) or "-"
        lines.append(f"| {r['setup']} | " + " | ".join(cells) + f" | {_fmt_x(r['zero/deepspeed'])} | "
                     f"{_fmt_x(r['zero/fsdp2'])} | {agree} |")  # fmt: skip
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerProcess:
    """The parent's handle on one peer's worker process (gpu/peer_workers.py): start, ask, replace."""

    def __init__(self, peer: str, device: str, shape: pc.Shape, micro: int, seq: int, count: int):
        self.peer = peer
        self.args = (device, shape, micro, seq, count)
        self.proc = None  # the worker's process while it lives
        self.conn = None  # the parent's end of its pipe
        self.hello: dict | None = None  # what the worker reported when it started (op loads)

    def start(self) -> None:
        import peer_workers

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        device = self.args[0]
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "DS_ACCELERATOR": "cuda" if device == "cuda" else "cpu"}  # fmt: skip
        # not a daemon: DeepSpeed's SuperOffload starts processes of its own
        self.proc = ctx.Process(target=peer_workers.serve, args=(child, self.peer, *self.args, env), daemon=False)
        self.proc.start()
        child.close()

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def receive(self, timeout: float) -> tuple[str, object]:
        """The worker's answer, or ("error", why) when it died or did not answer within ``timeout`` seconds."""
        if not self.conn.poll(max(timeout, 0.1)):
            alive = self.proc.is_alive()
            self.kill()
            return "error", f"no answer in {timeout:.0f} s" if alive else "worker died"
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            code = self.proc.exitcode
            self.kill()
            return "error", f"worker died (exit code {code})"

    def ask(self, timeout: float, *msg) -> tuple[str, object]:
        self.send(*msg)
        return self.receive(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.proc = None

    def stop(self) -> None:
        if self.alive():
            status, _ = self.ask(5, "exit")
            if status == "ok":
                self.proc.join(5)
        self.kill()


def _tail(text: object, lines: int = 30) -> str:
    """The last ``lines`` lines of a traceback (a failed JIT build prints its whole compiler output)."""
    return "\n".join(str(text).rstrip().splitlines()[-lines:])[-4000:]


def _last_line(text: object) -> str:
    """A traceback's exception line (the last one that names an error), else its last line."""
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception|Interrupt)\b", ln)]
    return (named or lines or ["error"])[-1][:300]


class Comparison:
    """The interleaved run over configurations: the peers' processes and the rounds' bookkeeping."""

    def __init__(self, args, shape: pc.Shape, micro: int, seq: int):
        self.args = args
        self.deadline = time.monotonic() + args.budget
        warm = max(args.warmup, args.compiled_warmup)
        count = warm + args.rounds * args.steps
        self.procs = {p: PeerProcess(p, args.device, shape, micro, seq, count) for p in args.peers}
        self.errors: dict[str, str] = {}  # a peer whose worker could not start (not tried again): why

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def ensure_started(self, peers: list[str]) -> list[str]:
        """Start the workers of ``peers`` that are not running (at once); the peers that are up."""
        peers = [p for p in peers if p not in self.errors]
        for p in peers:
            if not self.procs[p].alive():
                self.procs[p].start()
                self.procs[p].hello = None
        up = []
        for p in peers:
            proc = self.procs[p]
            if proc.hello is None:
                status, answer = proc.receive(min(SETUP_WAIT_S, self.left()))
                if status != "ok":
                    self.errors[p] = _last_line(answer)
                    print(f"peers: {p}'s worker did not start:\n{_tail(answer)}", flush=True)
                    continue
                proc.hello = answer
                print(f"peers: {p} worker up in {answer['start_s']:.1f} s; JIT ops (apart from steps): "
                      f"{answer['ops'] or 'none'}", flush=True)  # fmt: skip
            up.append(p)
        return up

    def _all(self, cells: dict[str, Cell], timeout: float, *msg) -> list[tuple[str, dict]]:
        """Send ``msg`` to every peer of ``cells`` without an error, then gather the answers; errors recorded."""
        asked = [p for p, c in cells.items() if not c.error]
        for p in asked:
            self.procs[p].send(*msg)
        out = []
        for p in asked:
            status, answer = self.procs[p].receive(timeout)
            if status == "ok":
                out.append((p, answer))
            else:
                cells[p].error = _last_line(answer)
                print(f"peers: {p} failed at {msg[0]}:\n{_tail(answer)}", flush=True)
        return out

    def run_setup(self, setup: pc.Setup) -> dict:
        peers = [p for p in self.args.peers if pc.runs(setup, p)]
        up = self.ensure_started(peers)
        cells = {p: Cell(error=None if p in up else f"worker: {self.errors.get(p, 'not started')}") for p in peers}
        wait = min(SETUP_WAIT_S, max(self.left() - 5, 1))
        for p, answer in self._all(cells, wait, "setup", setup.name):
            cells[p].setup_s = answer["setup_s"]
        warm = self.args.compiled_warmup if setup.compiled else self.args.warmup
        for p, answer in self._all(cells, wait, "steps", 0, warm):
            cells[p].losses += answer["losses"]
        for r, order in enumerate(round_orders(peers, self.args.rounds)):
            first = warm + r * self.args.steps
            for p in order:
                if cells[p].error:
                    continue
                status, answer = self.procs[p].ask(max(self.left() - 5, 1), "steps", first, self.args.steps)
                if status != "ok":
                    cells[p].error = _last_line(answer)
                    print(f"peers: {p} failed in round {r}:\n{_tail(answer)}", flush=True)
                    continue
                cells[p].times += answer["times"]
                cells[p].losses += answer["losses"]
        for p, answer in self._all(cells, 60, "close"):
            cells[p].peak_device_bytes = answer["peak_device_bytes"]
            if answer["left_device_bytes"] > LEFT_BYTES:  # what the closed engine did not free would crowd the next
                print(f"peers: {p} still holds {answer['left_device_bytes'] / 2**30:.1f} GiB after closing "
                      f"{setup.name}: its process is replaced", flush=True)  # fmt: skip
                self.procs[p].kill()
        for p, c in cells.items():
            if c.error:  # a failed peer's process may hold a broken CUDA context: the next setup gets a new one
                self.procs[p].kill()
        return row(setup, cells, self.args.peers)

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--setups", default=",".join(pc.SETUP_NAMES))
    ap.add_argument("--peers", default=",".join(pc.PEERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each peer per round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the rounds")
    ap.add_argument("--compiled-warmup", type=int, default=4, help="untimed steps before the rounds, compiled")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("ZERO_GPU_CHECK_SECONDS", 600)))
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    args.peers = args.peers.split(",")
    setups = [pc.setup_named(n) for n in args.setups.split(",")]
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: nothing to compare here (run on a machine with a GPU, or --device cpu)")
        return 0
    shape, micro, seq = (pc.PEER_SHAPE, pc.MICRO, pc.SEQ) if args.device == "cuda" else \
        (pc.CPU_SHAPE, pc.CPU_MICRO, pc.CPU_SEQ)  # fmt: skip
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"peers: {where}, {os.cpu_count()} CPU cores, torch {torch.__version__}; Llama {shape} "
          f"({shape.params() / 1e6:.1f}M parameters), {micro} x {seq} tokens a step, bf16, AdamW, clipping "
          f"{pc.CLIP}; {args.rounds} rounds of {args.steps} steps after {args.warmup} warm-up steps "
          f"({args.compiled_warmup} compiled)", flush=True)  # fmt: skip
    run = Comparison(args, shape, micro, seq)
    rows, skipped, started = [], [], time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # gpu/run.py's limit: the table is still printed
    try:
        for setup in setups:
            spent = max((r["seconds"] for r in rows), default=30.0)
            if run.left() < min(spent, 60.0):
                skipped.append(setup.name)
                continue
            t0 = time.monotonic()
            rows.append(run.run_setup(setup) | {"seconds": time.monotonic() - t0})
            print("\n".join(table(rows[-1:], args.peers)[2:]), f"({rows[-1]['seconds']:.0f} s)", flush=True)
    finally:  # the table first: the workers' exit may be slow, and the check's limit is near
        report(rows, skipped, args, time.monotonic() - started)
        run.close()
    return 0 if rows and all(passed(r) for r in rows) and not skipped else 1


def report(rows: list[dict], skipped: list[str], args, seconds: float) -> None:
    """Print the final table, each error and absent peer, what was not run; write --json."""
    import torch

    print(f"\nzero against DeepSpeed {_deepspeed_version()} and FSDP2 (torch {torch.__version__}), median step "
          f"ms; {seconds:.0f} s in all\n")  # fmt: skip
    print("\n".join(table(rows, args.peers)))
    for r in rows:
        for p, why in r["errors"].items():
            print(f"- {r['setup']}, {p}: {why}")
        for p, why in r["absent"].items():
            print(f"- {r['setup']}, {p}: n/a, {why}")
    if skipped:
        print(f"not run (time budget of {args.budget:.0f} s spent): {', '.join(skipped)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()


def _deepspeed_version() -> str:
    try:
        from importlib.metadata import version

        return version("deepspeed")
    except Exception:  # noqa: BLE001 - only for the report line
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
