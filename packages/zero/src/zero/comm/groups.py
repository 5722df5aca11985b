"""Process-group queries and set-up with ``deepspeed.comm``'s signatures (DeepSpeed 0.19.8)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from zero import distributed

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's default ``distributed_port``


def _require_init(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"zero.comm.{name}(): no process group; call zero.comm.init_distributed() first")


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialise the default process group (no-op when one exists), as ``deepspeed.comm.init_distributed``.

    Reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Given ``rank`` and ``world_size``
    (>= 0) without that environment, they are used with MASTER_ADDR 127.0.0.1 and ``distributed_port``. Without
    either, one process gets a one-rank group. Backend: ``dist_backend`` or NCCL with CUDA, else gloo.
    ``auto_mpi_discovery``, ``verbose``, ``config`` are accepted and unused (no MPI discovery: use torchrun).

    Raises:
        ValueError: ``dist_init_required=False`` while no process group exists (DeepSpeed's contract).
    """
    if dist_init_required is False and not dist.is_initialized():
        raise ValueError("init_distributed(dist_init_required=False): no process group exists; initialise one first")
    if rank >= 0 and world_size > 0 and "RANK" not in os.environ:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    distributed.init_distributed(dist_backend, timeout=timeout, init_method=init_method)


def is_initialized() -> bool:
    """True when the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    """True when torch.distributed is built in."""
    return dist.is_available()


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (default: WORLD); -1 when not a member. Raises RuntimeError before init."""
    _require_init("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    """Number of ranks in ``group`` (default: WORLD). Raises RuntimeError before init."""
    _require_init("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """Rank on this node: the launcher's LOCAL_RANK (0 without one). Raises RuntimeError before init."""
    _require_init("get_local_rank")
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    """Global rank of ``group_rank`` in ``group`` (default: WORLD, where it is ``group_rank`` itself)."""
    _require_init("get_global_rank")
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_world_group():
    """The default (WORLD) process group."""
    _require_init("get_world_group")
    return dist.group.WORLD


def new_group(ranks: list[int]):
    """A new process group over the global ``ranks`` (collective: every rank calls it)."""
    _require_init("new_group")
    return dist.new_group(ranks)


def destroy_process_group(group=None) -> None:
    """Destroy ``group`` (default: the default group and every other)."""
    dist.destroy_process_group(group)
