"""Parent side of the harness: warm worker pools, task dispatch, failure and timeout reporting."""

from __future__ import annotations

import atexit
import inspect
import multiprocessing as mp
import os
import pickle
import re
import signal
import tempfile
import time
from multiprocessing.connection import wait

from zero_comm.testing.worker import DUMP_SIGNAL, worker_main

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_TB_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
# Frames from these places are plumbing; the "called from" frame is the first one outside them.
_PLUMBING = (os.sep + "torch" + os.sep, os.sep + "zero_comm" + os.sep + "testing" + os.sep, "multiprocessing")


class RankFailure(RuntimeError):
    """A rank raised. ``rank`` is the rank, ``remote_traceback`` its formatted traceback, ``where`` a summary."""

    def __init__(self, rank: int, message: str, remote_traceback: str, finished: list[int]):
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.where = _summarise(_TB_FRAME.findall(remote_traceback)[::-1])
        self.finished = finished
        super().__init__(
            f"rank {rank} failed: {message}\n  where: rank {rank} {self.where}\n"
            f"  ranks that finished normally: {finished}\n--- remote traceback of rank {rank} ---\n{remote_traceback}"
        )


class RankTimeout(TimeoutError):
    """The wall-clock bound expired. ``stuck`` maps each unfinished rank to where its main thread was."""

    def __init__(self, timeout: float, stuck: dict[int, str], dumps: dict[int, str], finished: list[int]):
        self.stuck = stuck
        self.dumps = dumps
        self.finished = finished
        lines = [f"ranks {sorted(stuck)} did not finish within {timeout:.1f} s (finished: {finished}); all killed"]
        lines += [f"  rank {r} stuck {where}" for r, where in sorted(stuck.items())]
        for r, dump in sorted(dumps.items()):
            lines.append(f"--- stack dump of rank {r} ---\n{dump}")
        super().__init__("\n".join(lines))


def _summarise(frames: list[tuple[str, str, str]]) -> str:
    """frames: innermost first, as (file, line, func). 'in f (file:line), called from g (file:line)'."""
    if not frames:
        return "at an unknown place"
    file, line, func = frames[0]
    text = f"in {func} ({os.path.basename(file)}:{line})"
    for f2, l2, fn2 in frames:
        if not any(p in f2 for p in _PLUMBING):
            if (f2, l2, fn2) != frames[0]:
                text += f", called from {fn2} ({os.path.basename(f2)}:{l2})"
            break
    return text


def _main_thread_frames(dump: str) -> list[tuple[str, str, str]]:
    """Frames (innermost first) of the thread that runs the worker loop in a faulthandler dump."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump)
    for block in blocks:
        if "worker_main" in block:
            return _FRAME.findall(block)
    return _FRAME.findall(blocks[0]) if blocks else []


class _Pool:
    def __init__(self, world_size: int, threads: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.dump_dir = tempfile.mkdtemp(prefix=f"zero-harness-ws{world_size}-")
        self.conns, self.procs, self.dump_paths = [], [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            dump_path = os.path.join(self.dump_dir, f"rank{rank}.txt")
            proc = ctx.Process(target=worker_main, args=(child, dump_path, threads), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.dump_paths.append(dump_path)

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker has started (imported torch, installed its stack-dump handler).

        Raises RuntimeError naming the ranks that died or did not start within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            remaining = deadline - time.monotonic()
            ready = wait(list(waiting), timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                self.kill()
                raise RuntimeError(f"harness: ranks {sorted(waiting.values())} did not start within {timeout:.0f} s")
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    conn.recv()
                except (EOFError, OSError):
                    self.kill()
                    raise RuntimeError(f"harness: rank {rank} died while starting "
                                       f"(exit code {self.procs[rank].exitcode})") from None  # fmt: skip

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, DUMP_SIGNAL)
        # Poll rather than sleep a fixed time: on a loaded machine a dump can take well over 0.5 s to appear.
        deadline = time.monotonic() + DUMP_WAIT
        out = {}
        while True:
            for r in ranks:
                try:
                    with open(self.dump_paths[r]) as f:
                        text = f.read().strip()
                except OSError:
                    text = ""
                if text and "worker_main" in text:
                    out[r] = text
            if len(out) == len(ranks) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for r in ranks:
            if r not in out:
                out[r] = f"(no dump: the process did not answer the signal in {DUMP_WAIT:.0f} s)"
        return out

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(timeout=5)
        for c in self.conns:
            c.close()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=2)
        self.kill()


_POOLS: dict[int, _Pool] = {}
# Bounds that are not a test body's: spawning workers and importing torch and the test module can take minutes on
# a machine shared with other CPU-bound jobs, and a dump can take seconds to arrive there.
STARTUP_TIMEOUT = float(os.environ.get("ZERO_HARNESS_STARTUP_TIMEOUT", 600))
DUMP_WAIT = 30.0


def shutdown_pools() -> None:
    """Stop every warm worker (also run at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(shutdown_pools)


def _get_pool(world_size: int, threads: int) -> _Pool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()
        pool = _Pool(world_size, threads)
        pool.wait_ready(STARTUP_TIMEOUT)
        _POOLS[world_size] = pool
    return pool


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    pg_timeout: float | None = None,
    threads: int | None = None,
    seed: int = 0,
    **kwargs,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results, rank order.

    Args:
        fn: a module-level function (it is found again by module, name and file in each worker).
        world_size: number of ranks (processes), >= 1.
        timeout: wall-clock bound in seconds for the body, counted from when every rank has found ``fn`` (its
            module imported); then every rank is killed. Starting workers and importing are bounded apart
            (``STARTUP_TIMEOUT``, 600 s; env ``ZERO_HARNESS_STARTUP_TIMEOUT``), so a busy machine does not eat it.
        pg_timeout: gloo's own timeout for each collective wait, in seconds (default 0.75 x ``timeout``, so a
            rank stuck in a collective raises there, with its traceback, before the harness kills it).
        threads: torch intra-op threads per rank for this call (default: the cores divided by ranks, at least 1);
            a warm pool started for another count serves it with this one.
        seed: ``torch.manual_seed`` applied on every rank before ``fn`` runs.

    Raises:
        RankFailure: a rank raised or died; carries the rank, the remote traceback and the ranks that finished.
            A rank that died (within 3 s of the first error) is reported over a peer's error, which is its
            consequence (a collective that lost its peer).
        RankTimeout: the bound expired; names the unfinished ranks and where each was stuck.
        ValueError: ``world_size`` < 1 or ``fn`` is not a module-level function.
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if "<locals>" in fn.__qualname__ or "<lambda>" in fn.__qualname__:
        raise ValueError(f"fn must be a module-level function so workers can find it, got {fn.__qualname__}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    pg_timeout = pg_timeout if pg_timeout is not None else 0.75 * timeout
    try:
        path = inspect.getfile(fn)
    except TypeError:
        path = None
    payload = pickle.dumps((args, kwargs))
    master = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    pool = _get_pool(world_size, threads)
    for rank, conn in enumerate(pool.conns):
        task = dict(
            module=fn.__module__, qualname=fn.__qualname__, path=path, payload=payload, host="127.0.0.1",
            port=master.port, rank=rank, world_size=world_size, pg_timeout=pg_timeout, seed=seed, threads=threads,
        )  # fmt: skip
        conn.send(task)

    # Until every rank has imported the test module the bound is STARTUP_TIMEOUT; then ``timeout`` for the body.
    deadline = time.monotonic() + max(timeout, STARTUP_TIMEOUT)
    begun: set[int] = set()
    results: dict[int, object] = {}
    first_error = None
    pending = {conn: rank for rank, conn in enumerate(pool.conns)}
    while pending:
        remaining = deadline - time.monotonic()
        if first_error is not None:
            # Give the other ranks a moment to report their own errors, then stop waiting on them.
            remaining = min(remaining, first_error[3] - time.monotonic())
        if remaining <= 0:
            break
        for conn in wait(list(pending), timeout=remaining):
            rank = pending.pop(conn)
            dead = False
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                code = pool.procs[rank].exitcode
                msg = ("error", f"rank process died (exit code {code})", "(no traceback: the process died)")
                dead = True
            if msg[0] == "begin":
                pending[conn] = rank
                begun.add(rank)
                if len(begun) == world_size:
                    deadline = time.monotonic() + timeout
            elif msg[0] == "ok":
                results[rank] = pickle.loads(msg[1])
            elif first_error is None:
                first_error = (rank, msg[1], msg[2], time.monotonic() + 3.0, dead)
            elif dead and not first_error[4]:
                # a dead rank is the cause; a peer's collective error that reached us first is its consequence
                first_error = (rank, msg[1], msg[2], first_error[3], dead)
    del master
    finished = sorted(results)
    if first_error is not None:
        _POOLS.pop(world_size, None)
        pool.kill()
        raise RankFailure(first_error[0], first_error[1], first_error[2], finished)
    if pending:
        stuck_ranks = sorted(pending.values())
        dumps = pool.dump_stacks(stuck_ranks)
        _POOLS.pop(world_size, None)
        pool.kill()
        stuck = {r: _summarise(_main_thread_frames(d)) for r, d in dumps.items()}
        raise RankTimeout(timeout, stuck, dumps, finished)
    return [results[r] for r in range(world_size)]
