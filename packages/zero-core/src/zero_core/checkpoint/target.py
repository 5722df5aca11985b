"""What checkpointing needs from a sharded training runtime, as a small protocol, plus RNG state helpers.

``ZeroRuntime`` (zero_core) provides this; so can any runtime (tests use a small one) that keeps its trainable
parameters in flat, range-sharded fp32 master buffers stepped by a plain ``torch.optim.Optimizer``.
"""

from __future__ import annotations

import random
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from zero_core.layout import FlatGroup


@runtime_checkable
class ProvidesCheckpointable(Protocol):
    """What save and load accept: a runtime (``ZeroRuntime``) or a ``Checkpointable``, either giving the
    ``Checkpointable`` they work on."""

    def checkpointable(self) -> Checkpointable:
        """The ``Checkpointable`` view (a ``Checkpointable`` returns itself)."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """The runtime side of save/load.

    Attributes:
        stage: ZeRO stage 0-3.
        group: the data-parallel process group, or None for a single process without ``torch.distributed``.
        module: the wrapped model; ``module.state_dict(keep_vars=True)`` must list every key (full or sharded).
        optimizer: the torch optimizer whose params are exactly the master shard tensors of
            :meth:`checkpoint_groups`, with ``hyper_groups()``: its param groups' hyper-parameters without
            ``params``, and ``trainable()``: the trainable flat groups in its parameter order; neither reads a
            shard (``zero_core.checkpoint.master_view.MasterOptimizerView``).
    """

    stage: int
    group: Any
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def checkpointable(self) -> Checkpointable:
        """Itself (``ZeroRuntime.checkpointable()`` gives its adapter: save and load call this on either)."""
        ...

    def checkpoint_groups(self) -> Sequence[tuple[FlatGroup, torch.Tensor]]:
        """Every flat buffer: its layout and this rank's shard, shape ``(layout.shard_numel,)``: for trainable
        buffers the fp32 master (the very tensor object the optimizer steps), for frozen ones (``group_index``
        None) the stored values in their own dtype. Ranks ``>= group.partitions`` hold a copy of shard 0."""
        ...

    def streamed_groups(self) -> Sequence[tuple[FlatGroup, torch.Tensor | dict]]:
        """As :meth:`checkpoint_groups`, but a group whose master state lives in swap files comes as the dict of
        pieces its master store streams (``zero_core.checkpoint.pieces``) instead of one tensor (the save's path)."""
        ...

    def gathered_model_state(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Full-shape values of the given ``module.state_dict()`` entries, one at a time, in the model's dtype.

        Collective at stage 3 (every rank calls it with the same names); values may be views that are only valid
        until the next item is requested.
        """
        ...

    def load_master_shards(self, shards: dict[str, torch.Tensor]) -> None:
        """Copy group key -> shard (as :meth:`checkpoint_groups` gives) in and refresh the model's parameters."""
        ...

    def load_model_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load full-shape values of entries outside the flat buffers (buffers, frozen params) into the model."""
        ...


def rank_and_world(group: Any) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` when ``group`` is None and no default group exists."""
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: torch CPU, every CUDA device (if initialised), Python ``random``, numpy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng` (CUDA only when the saved device count matches)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def state_dict_vars(module: torch.nn.Module) -> dict:
    """``module.state_dict(keep_vars=True)`` for reading keys, shapes and storage identity. Stage 3's warning about
    released (empty) parameters is meant for users reading values, not for this bookkeeping, so it is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="stage 3: state_dict")
        return module.state_dict(keep_vars=True)
