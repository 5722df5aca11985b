"""A self-contained ShardSource for tests of the compiled path without the core: one unit per module with direct
parameters, padded to the world size; gradient chunks accumulate in a dict. It lays the parameters out itself, so
it claims them in ``zero_core.registry`` (as ``ZeroRuntime`` does), where the store finds their units."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor
from zero_compile.layout import CompiledLayout
from zero_core import registry
from zero_core.layout import Bucket, FlatGroup, ParamSlot


class LocalShards:
    """A :class:`~zero_compile.layout.ShardSource` sharding ``module`` by itself: one unit per module with direct
    parameters (module order), padded to the world size. With ``release`` the parameters' storage is emptied (as
    the core's stage 3 leaves it between uses). Reduced gradient chunks accumulate in ``grads`` (unit -> chunk);
    :meth:`full_grads` gathers them back (collective). ``flat_groups``: one flat group per unit (what
    ``zero_core.registry`` reads); its parameters stay claimed while this object lives."""

    def __init__(self, module: torch.nn.Module, group, *, release: bool = True):
        self.group = group
        self.reduce_dtype = None  # gradients are reduced in their own dtype
        world, rank = group.size(), dist.get_rank(group)
        units, self._params, self._shards, self.flat_groups = [], [], [], []
        for mod in module.modules():
            own = [(n, p) for n, p in mod.named_parameters(recurse=False)]
            if not own:
                continue
            slots, pos = [], 0
            for n, p in own:
                slots.append(ParamSlot(n, tuple(p.shape), p.numel(), pos, pos, param=p))
                pos += p.numel()
            padded = -(-pos // world) * world
            flat = torch.zeros(padded)
            for s, (_, p) in zip(slots, own):
                flat[s.bucket_offset : s.bucket_offset + s.numel] = p.detach().reshape(-1)
            chunk = padded // world
            self._shards.append(flat[rank * chunk : (rank + 1) * chunk].clone())
            idx = len(units)
            units.append(Bucket(idx, tuple(slots), 0, pos, padded, chunk, 0, persistent=False))
            self.flat_groups.append(FlatGroup(idx, 0, flat.dtype, world, rank, (units[-1],)))
            for i, (_, p) in enumerate(own):
                self._params.append((p, idx, i))
                if release:
                    p.data = torch.empty(p.shape)
                    p.untyped_storage().resize_(0)
        self.layout = CompiledLayout(tuple(units), world, rank)
        self.grads: dict[int, torch.Tensor] = {}
        registry.claim(self)

    def params(self):
        return list(self._params)

    def shard(self, unit):
        return self._shards[unit]

    def add_grad_shard(self, unit, chunk, slots, *, offset=0, ready=True):
        if unit not in self.grads:
            self.grads[unit] = torch.zeros(self.layout.units[unit].chunk, dtype=chunk.dtype)
        self.grads[unit][offset : offset + chunk.numel()] += chunk

    def full_grads(self) -> dict[tuple[int, str], torch.Tensor]:
        """(unit, parameter name inside its module) -> full gradient, fp32. Collective."""
        out = {}
        for i, u in enumerate(self.layout.units):
            chunk = self.grads.get(i, torch.zeros(u.chunk))
            full = torch.empty(u.padded_numel)
            all_gather_into_tensor(full, chunk.contiguous(), self.group)
            for s in u.slots:
                out[(i, s.name)] = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)
        return out
