"""Adapter: a :class:`zero_core.ZeroRuntime` seen through the :class:`Checkpointable` protocol.

Every ``runtime.flat_groups`` entry becomes one checkpoint buffer (key ``group<i>``) with its buckets; trainable
buffers carry the fp32 master shard the optimizer steps, frozen ones their stored shard (stage 3) or the whole
buffer (stages 0-2, one shard). Buffers (``register_buffer``) are full on every rank and go to the model file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from zero_core.checkpoint.master_view import MasterOptimizerView
from zero_core.checkpoint.target import Checkpointable, ProvidesCheckpointable, state_dict_vars
from zero_core.layout import FlatGroup


class ZeroRuntimeCheckpoint:
    """Wraps a ``ZeroRuntime`` (``flat_groups``: the layout the checkpoint records as it is; ``master``: the
    master store; ``shards()``, ``load_master_shards(list)``)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.stage = runtime.stage
        self.group = runtime.group
        self.module = runtime.module
        self.optimizer = MasterOptimizerView(runtime)

    def _master(self, fg: FlatGroup):
        return self.runtime.master.master_shard(fg)

    def _shard(self, fg, stored: torch.Tensor) -> torch.Tensor:
        """This rank's shard, ``shard_numel`` elements. A frozen whole buffer (stages 0-2) comes back from
        ``shards()`` unpadded, so its bucket padding is put back here."""
        if self._master(fg) is not None or stored.numel() == fg.shard_numel:
            return stored
        out = torch.zeros(fg.shard_numel, dtype=stored.dtype)
        for b in fg.buckets:
            out[b.shard_offset : b.shard_offset + b.numel] = stored[b.start : b.start + b.numel]
        return out

    def checkpointable(self) -> ZeroRuntimeCheckpoint:
        return self

    def checkpoint_groups(self) -> list[tuple[FlatGroup, torch.Tensor]]:
        shards = self.runtime.shards()
        out = []
        for fg, stored in zip(self.runtime.flat_groups, shards):
            master = self._master(fg)
            master = master if master is not None else self._shard(fg, stored)
            out.append((fg, master))
        return out

    def streamed_groups(self) -> list[tuple[FlatGroup, torch.Tensor | dict]]:
        """As :meth:`checkpoint_groups`, but a group whose master store streams its state
        (``master.checkpoint_pieces(fg)``, see ``zero_core.checkpoint.pieces``) comes with that dict instead of a
        tensor, and its master is never read whole (the save's path)."""
        out = []
        for fg in self.runtime.flat_groups:
            streamed = self.runtime.master.checkpoint_pieces(fg)
            if streamed is not None:
                out.append((fg, streamed))
                continue
            master = self._master(fg)
            out.append((fg, master if master is not None else self._shard(fg, self.runtime._stored(fg))))
        return out

    def gathered_model_state(self, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
        state = state_dict_vars(self.module)
        for name in names:
            yield name, state[name].detach()

    def load_master_shards(self, shards: dict[str, torch.Tensor]) -> None:
        ordered = []
        for fg in self.runtime.flat_groups:
            shard = shards[f"group{fg.index}"]
            if fg.group_index is None and fg.partitions == 1 and self.stage != 3:  # frozen: no master to read
                # stages 0-2 take a frozen whole buffer unpadded (``shards()`` form)
                shard = torch.cat([shard[b.shard_offset : b.shard_offset + b.numel] for b in fg.buckets])
            ordered.append(shard)
        self.runtime.load_master_shards(ordered)

    @torch.no_grad()
    def load_model_state(self, tensors: dict[str, torch.Tensor]) -> None:
        state = state_dict_vars(self.module)
        for name, value in tensors.items():
            if state[name].shape != value.shape:
                raise ValueError(f"{name}: checkpoint shape {list(value.shape)}, model {list(state[name].shape)}")
            state[name].copy_(value)


def as_checkpointable(runtime: ProvidesCheckpointable) -> Checkpointable:
    """What save and load work on: ``runtime.checkpointable()`` (a ``ZeroRuntime`` gives its adapter, a
    ``Checkpointable`` itself).

    Raises:
        TypeError: ``runtime`` does not declare ``checkpointable()`` (neither a ZeroRuntime nor a Checkpointable).
    """
    if not isinstance(runtime, ProvidesCheckpointable):
        raise TypeError(f"{type(runtime).__name__} is neither a ZeroRuntime nor a Checkpointable")
    return runtime.checkpointable()
