"""Process-group set-up as DeepSpeed's ``init_distributed``: gloo on CPU, NCCL on GPU, torchrun's environment,
an explicit ``init_method`` rendezvous (``env://``, ``tcp://``, ``file://``) with ``rank`` and ``world_size``, or an
MPI launcher's environment."""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time

import torch
import torch.distributed as dist

from zero.log import logger

DEFAULT_TIMEOUT_MINUTES = 10
"""DeepSpeed's default process-group timeout in minutes; the ``DEEPSPEED_TIMEOUT`` environment variable overrides it."""

# (rank, world size, local rank) variables of the MPI launchers: Open MPI, then MPICH / Intel MPI (Hydra).
_MPI_ENV = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_timeout() -> datetime.timedelta:
    """DeepSpeed's default process-group timeout: ``DEEPSPEED_TIMEOUT`` minutes (an integer), else 10 minutes.

    Raises:
        ValueError: ``DEEPSPEED_TIMEOUT`` is not a positive integer.
    """
    raw = os.environ.get("DEEPSPEED_TIMEOUT", str(DEFAULT_TIMEOUT_MINUTES))
    try:
        minutes = int(raw)
    except ValueError:
        minutes = 0
    if minutes <= 0:
        raise ValueError(f"DEEPSPEED_TIMEOUT={raw!r}: expected a positive whole number of minutes")
    return datetime.timedelta(minutes=minutes)


def _mpi_env(distributed_port: int, verbose: bool) -> tuple[int, int] | None:
    """An MPI launcher's rank and world size copied into torch's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_PORT), as DeepSpeed's MPI discovery does; None when no MPI launcher started this process."""
    found = [names for names in _MPI_ENV if names[0] in os.environ and names[1] in os.environ]
    if not found:
        return None
    rank_var, size_var, local_var = found[0]
    rank, world = int(os.environ[rank_var]), int(os.environ[size_var])
    if world > 1 and "MASTER_ADDR" not in os.environ:
        raise ValueError(f"init_distributed: an MPI launcher set {rank_var}/{size_var} (world size {world}) but "
                         "MASTER_ADDR is not set; export MASTER_ADDR=<rank 0's host> to every rank")  # fmt: skip
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get(local_var, "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    if verbose and rank == 0:
        logger.info(f"init_distributed: MPI environment found ({rank_var}/{size_var}): world size {world}, "
                    f"MASTER_ADDR={os.environ['MASTER_ADDR']} MASTER_PORT={os.environ['MASTER_PORT']}")  # fmt: skip
    return rank, world


def _rank_world(rank: int, world_size: int) -> tuple[int, int] | None:
    """The explicit ``rank``/``world_size`` (both >= 0), else the launcher's RANK/WORLD_SIZE, else None."""
    if (rank >= 0) != (world_size > 0):
        raise ValueError(f"init_distributed(rank={rank}, world_size={world_size}): give both rank (>= 0) and "
                         "world_size (>= 1), or neither")  # fmt: skip
    if rank >= 0:
        if rank >= world_size:
            raise ValueError(f"init_distributed: rank={rank} is not below world_size={world_size}")
        return rank, world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def init_distributed(dist_backend: str | None = None, timeout: datetime.timedelta | None = None,
                     init_method: str | None = None, distributed_port: int | None = None, rank: int = -1,
                     world_size: int = -1, auto_mpi_discovery: bool = True, verbose: bool = True) -> None:  # fmt: skip
    """Initialise the default process group, as ``deepspeed.comm.init_distributed`` (a no-op when one exists).

    Where rank and world size come from, first found wins: ``rank`` and ``world_size`` (both given), torchrun's
    RANK/WORLD_SIZE, then (``auto_mpi_discovery``) an MPI launcher's OMPI_COMM_WORLD_* or PMI_* variables,
    copied into RANK/WORLD_SIZE/LOCAL_RANK as DeepSpeed does. With none of them a single process gets a one-rank
    group over an in-memory store, so the same code path serves one and many ranks.

    ``init_method`` is torch's rendezvous URL (``env://`` by default, ``tcp://host:port``, ``file:///path``); the
    rank and world size found above are passed with it (a ``file://`` or ``tcp://`` rendezvous needs them).
    Without ``init_method``, MASTER_ADDR defaults to 127.0.0.1 and MASTER_PORT to ``distributed_port`` (DeepSpeed's
    29500) when the environment lacks them. ``timeout`` bounds every collective wait (default: DeepSpeed's,
    ``DEEPSPEED_TIMEOUT`` minutes or 10). ``verbose`` logs the set-up on rank 0 (logger ``zero``, level INFO).
    On GPU the local rank's device becomes current.

    A group created here is destroyed at interpreter exit (an ``atexit`` handler), unless the script destroyed it
    first: gloo's worker threads can still hold finished work whose tensors are freed during finalization, which
    aborts the process ("terminate called without an active exception") after the script has succeeded. Called
    when a group exists (Accelerate's, through ``initialize``), it registers only the second half of that handler:
    the reference cycles still holding groups are collected at exit, the group itself is left to its creator.

    Raises:
        ValueError: only one of ``rank``/``world_size`` given, ``rank >= world_size``, an MPI world larger than
            one without MASTER_ADDR, or a bad DEEPSPEED_TIMEOUT.
        TypeError: ``timeout`` is not a ``datetime.timedelta``.
    """
    if dist.is_initialized():
        # a group created elsewhere (Accelerate, the script) stays its creator's; only the cycles holding groups go
        atexit.unregister(_collect_at_exit)
        atexit.register(_collect_at_exit)
        return
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"init_distributed(timeout=...): expected a datetime.timedelta, got {type(timeout).__name__}")
    timeout = timeout if timeout is not None else default_timeout()
    port = 29500 if distributed_port is None else int(distributed_port)
    backend = dist_backend or default_backend()
    found = _rank_world(rank, world_size)
    if found is None and auto_mpi_discovery:
        found = _mpi_env(port, verbose)
    atexit.unregister(_destroy_at_exit)  # once, however often a script re-initialises
    atexit.register(_destroy_at_exit)
    if found is None and init_method is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    r, n = found if found is not None else (-1, -1)
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("LOCAL_RANK", "0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if verbose and r <= 0:
        logger.info(f"init_distributed: backend {backend}, world size {n}, rendezvous {init_method or 'env://'}, "
                    f"timeout {timeout}")  # fmt: skip
    dist.init_process_group(backend=backend, init_method=init_method, timeout=timeout, rank=r, world_size=n)


def _destroy_at_exit() -> None:
    # Runs while the interpreter can still free tensors; destroying is local (no collective with the peers).
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _collect_at_exit()


def _collect_at_exit() -> None:
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
