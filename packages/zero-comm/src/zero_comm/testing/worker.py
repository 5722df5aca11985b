"""The worker side of the harness: one long-lived process per rank that runs test bodies on request."""

from __future__ import annotations

import faulthandler
import gc
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import traceback
import weakref
from datetime import timedelta

# Sent by the parent before killing a stuck worker: dump every thread's Python stack to the worker's dump file.
DUMP_SIGNAL = signal.SIGUSR1


def resolve(module: str, qualname: str, path: str | None):
    """Find a function by module and qualified name, loading the module from its file when it is not importable.

    pytest's importlib mode gives test modules names that a fresh process cannot import, hence the file path.
    """
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if path is None:
                raise
            spec = importlib.util.spec_from_file_location(module, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _run_one(task: dict, fn, threads: int):
    import torch
    import torch.distributed as dist

    args, kwargs = pickle.loads(task["payload"])
    store = dist.TCPStore(task["host"], task["port"], is_master=False, timeout=timedelta(seconds=task["pg_timeout"]))
    dist.init_process_group(
        "gloo",
        store=store,
        rank=task["rank"],
        world_size=task["world_size"],
        timeout=timedelta(seconds=task["pg_timeout"]),
    )
    try:
        # Every rank is connected before any body runs: a rank that raised at once used to close its side while a
        # slower peer was still connecting, and the peer's connection error could be reported first.
        dist.barrier()
        torch.manual_seed(task.get("seed", 0))
        # per task, not per process: a warm worker serves calls that ask for different thread counts
        torch.set_num_threads(task.get("threads", threads))
        return fn(*args, **kwargs)
    finally:
        groups = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map]
        dist.destroy_process_group()
        # Free, here and on every rank, the groups that this task's reference cycles still hold. A group freed
        # while one of its collectives is in flight (a test that left a rank's collective unmatched) waits in its
        # destructor until each peer has freed its copy: at a garbage collection in a later task it would wait
        # for a peer that may never collect, until the collective's own timeout.
        if any(ref() is not None for ref in groups):
            gc.collect()


def worker_main(conn, dump_path: str, threads: int) -> None:
    """Loop: receive a task, run it, send back ("ok", pickled result) or ("error", text, traceback).

    ``threads``: the OpenMP pool size the process starts with; each task sets torch's intra-op threads it asked for.

    Also sends ("ready",) once after start-up and ("begin",) when a task's function is found (its module imported),
    so the parent can start a body's wall-clock bound there."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    dump_file = open(dump_path, "w")  # noqa: SIM115 - kept open for faulthandler for the process lifetime
    faulthandler.register(DUMP_SIGNAL, file=dump_file, all_threads=True)
    import torch

    gc.freeze()  # what start-up imported lives as long as the process: every later collection skips it
    torch.set_num_threads(threads)
    conn.send(("ready",))  # started: the parent's clocks for test bodies exclude start-up, slow on a busy machine
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        try:
            fn = resolve(task["module"], task["qualname"], task["path"])  # imports the test module
            conn.send(("begin",))  # the body's wall-clock bound starts now, not during imports
            result = _run_one(task, fn, threads)
            conn.send(("ok", pickle.dumps(result)))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent with its traceback
            conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
