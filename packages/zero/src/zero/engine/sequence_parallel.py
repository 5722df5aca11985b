"""``initialize(mpu=...)`` for sequence parallelism: what the engine asks of DeepSpeed's sequence-parallel ``mpu``
and the groups it takes from it.

DeepSpeed 0.19.8 shards ZeRO over the sequence-data-parallel group (sp x dp) when an ``mpu`` with the
sequence-parallel methods is given, counts ``train_batch_size`` over the data-parallel ranks only (ranks that share
a sequence see the same samples), and answers ``deepspeed.utils.groups`` from that ``mpu``. zero's engine does the
same; zero_core only receives the process group it shards over (it knows groups, not strategies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch.distributed as dist

from zero.config import ConfigError


@runtime_checkable
class SequenceParallelMPU(Protocol):
    """What the engine uses of an ``mpu`` (zero_parallel's ``SequenceParallelMPU``, DeepSpeed's
    ``parallel_state_sp``): process groups are ``torch.distributed.ProcessGroup``; sizes and ranks are ints."""

    def get_sequence_parallel_group(self): ...
    def get_sequence_parallel_world_size(self) -> int: ...
    def get_sequence_parallel_rank(self) -> int: ...
    def get_data_parallel_group(self): ...
    def get_data_parallel_world_size(self) -> int: ...
    def get_data_parallel_rank(self) -> int: ...
    def get_sequence_data_parallel_group(self): ...
    def get_sequence_data_parallel_world_size(self) -> int: ...
    def get_sequence_data_parallel_rank(self) -> int: ...


_METHODS = tuple(name for name in SequenceParallelMPU.__dict__ if name.startswith("get_"))


@dataclass(frozen=True)
class ParallelGroups:
    """The groups one engine trains over. ``shard_group`` None: the whole world (no ``mpu``).

    Attributes:
        sequence_parallel_size: ranks sharing one sequence (1 without an ``mpu``).
        data_parallel_size / data_parallel_rank: what the batch triple and the training loader count.
        shard_group: the group ZeRO partitions over and averages gradients over (sp x dp), or None for WORLD.
    """

    sequence_parallel_size: int
    data_parallel_size: int
    data_parallel_rank: int
    shard_group: object | None


def check_mpu_methods(mpu) -> None:
    """TypeError naming the methods ``mpu`` lacks of :class:`SequenceParallelMPU` (checked before any work).

    zero has no tensor or pipeline parallelism, so an ``mpu`` without the sequence-parallel methods (Megatron's
    model-parallel unit) is refused rather than half-served."""
    if isinstance(mpu, SequenceParallelMPU):
        return
    missing = [name for name in _METHODS if not callable(getattr(mpu, name, None))]
    raise TypeError(f"initialize(mpu=...): {type(mpu).__name__} lacks {', '.join(missing)}; zero serves DeepSpeed's "
                    "sequence-parallel mpu only (the one UlyssesSPAttentionHF.register_with_transformers returns); "
                    "tensor and pipeline parallelism are not implemented")  # fmt: skip


def parallel_groups(mpu: SequenceParallelMPU | None, sequence_parallel_size: int | None) -> ParallelGroups:
    """The engine's groups from ``mpu`` (None: the whole world, data parallel only), checked against the config.

    Args:
        mpu: checked with :func:`check_mpu_methods` first, or None.
        sequence_parallel_size: the config's ``sequence_parallel_size``; None when the config leaves it out
            (then the mpu's size is used).

    Raises:
        ConfigError: ``sequence_parallel_size`` differs from ``mpu.get_sequence_parallel_world_size()`` (both
            named), or is above 1 without an ``mpu``.
        ValueError: the mpu's sizes do not multiply out (sp x dp != the sequence-data-parallel group's size).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mpu is None:
        if sequence_parallel_size not in (None, 1):
            raise ConfigError(f"config key 'sequence_parallel_size': {sequence_parallel_size} needs the "
                              "sequence-parallel mpu: pass initialize(mpu=UlyssesSPAttentionHF."
                              "register_with_transformers(...)), or set it to 1")  # fmt: skip
        return ParallelGroups(1, world, dist.get_rank() if dist.is_initialized() else 0, None)
    sp = mpu.get_sequence_parallel_world_size()
    if sequence_parallel_size is not None and sp != sequence_parallel_size:
        raise ConfigError(f"config key 'sequence_parallel_size': {sequence_parallel_size} differs from the mpu's "
                          f"get_sequence_parallel_world_size() = {sp}; make them equal")  # fmt: skip
    dp, sdp = mpu.get_data_parallel_world_size(), mpu.get_sequence_data_parallel_world_size()
    group = mpu.get_sequence_data_parallel_group()
    if sp * dp != sdp or dist.get_world_size(group) != sdp:
        raise ValueError(
            f"initialize(mpu=...): sequence-parallel size {sp} x data-parallel size {dp} must equal the "
            f"sequence-data-parallel size {sdp} and its group's {dist.get_world_size(group)} ranks"
        )
    return ParallelGroups(sp, dp, mpu.get_data_parallel_rank(), group)
