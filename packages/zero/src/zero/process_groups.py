"""Process-group queries and set-up with DeepSpeed 0.19.8's signatures (served as ``deepspeed.comm``)."""

from __future__ import annotations

import datetime
import json
import os

import pydantic
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

    Every argument keeps DeepSpeed 0.19.8's meaning; :func:`zero.distributed.init_distributed` documents where
    rank and world size come from (``rank``/``world_size``, torchrun's RANK/WORLD_SIZE, an MPI launcher's
    variables when ``auto_mpi_discovery``) and how ``init_method`` (``env://``, ``tcp://``, ``file://``),
    ``distributed_port``, ``timeout`` (default ``DEEPSPEED_TIMEOUT`` minutes or 10) and ``verbose`` are used.
    Backend: ``dist_backend`` or NCCL with CUDA, else gloo. ``config`` (a dict, a JSON path or a
    :class:`~zero.DeepSpeedConfig`) is checked here so that a bad ``comms_logger`` section fails before any rank
    waits; the comms logger itself starts with the engine that ``initialize()`` builds from the same config.

    Raises:
        ValueError: ``dist_init_required=False`` while no process group exists (DeepSpeed's contract), or the
            rank/world-size errors of :func:`zero.distributed.init_distributed`.
        ConfigError: ``config``'s ``comms_logger`` section is invalid (names the key).
        TypeError: ``config`` or ``timeout`` of the wrong type.
    """
    if dist_init_required is False and not dist.is_initialized():
        raise ValueError("init_distributed(dist_init_required=False): no process group exists; initialise one first")
    if config is not None:
        _check_comms_config(config)
    distributed.init_distributed(dist_backend, timeout=timeout, init_method=init_method,
                                 distributed_port=distributed_port, rank=rank, world_size=world_size,
                                 auto_mpi_discovery=auto_mpi_discovery, verbose=verbose)  # fmt: skip


def _check_comms_config(config) -> None:
    from zero.compat.config import DeepSpeedConfig
    from zero.config import ConfigError
    from zero.config.sections import CommsLoggerSection

    if isinstance(config, DeepSpeedConfig):
        config = config._param_dict
    elif isinstance(config, str | os.PathLike):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"init_distributed(config=...): expected a dict, a JSON path or a DeepSpeedConfig, "
                        f"got {type(config).__name__}")  # fmt: skip
    try:
        CommsLoggerSection.model_validate(config.get("comms_logger", {}))
    except pydantic.ValidationError as e:
        keys = ", ".join("comms_logger." + ".".join(map(str, err["loc"])) for err in e.errors())
        raise ConfigError(f"init_distributed(config=...): invalid {keys}: {e.errors()[0]['msg']}") from None


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
