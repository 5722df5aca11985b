"""Process-group set-up as DeepSpeed's ``init_distributed``: gloo on CPU, NCCL on GPU, torchrun's environment."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(dist_backend: str | None = None, timeout: datetime.timedelta | None = None,
                     init_method: str | None = None, distributed_port: int | None = None) -> None:  # fmt: skip
    """Initialise the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    ``distributed_port`` fills MASTER_PORT when the environment lacks it (DeepSpeed's argument; default 29500 there).

    Mirrors ``deepspeed.init_distributed``: a no-op when already initialised. Without torchrun's variables a single
    process gets a one-rank group over an in-memory store, so the same code path serves one and many ranks. On GPU
    the local rank's device becomes current.

    A group created here is destroyed at interpreter exit (an ``atexit`` handler), unless the script destroyed it
    first: gloo's worker threads can still hold finished work whose tensors are freed during finalization, which
    aborts the process ("terminate called without an active exception") after the script has succeeded.
    """
    if dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    atexit.unregister(_destroy_at_exit)  # once, however often a script re-initialises
    atexit.register(_destroy_at_exit)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return
    if distributed_port is not None:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend=backend, init_method=init_method, **kwargs)


def _destroy_at_exit() -> None:
    # Runs while the interpreter can still free tensors; destroying is local (no collective with the peers).
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # A group's C++ object outlives destroy_process_group while Python objects still hold it (an engine caught in a
    # reference cycle), and its gloo threads drop finished work, which takes the GIL, just after a wait returned:
    # collect those cycles now and give the threads the GIL, so none needs it once finalization has begun (a
    # 2-core run of the autotuner's training script aborted 2 times in 20 without this, 0 in 48 with it).
    gc.collect()
    time.sleep(0.02)


def rank_world(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``; ``(0, 1)`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
