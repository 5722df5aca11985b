"""ZeRO++ inside stage 3 (arXiv 2306.10209): qwZ, qgZ and hpZ wired to zero_comm's collectives.

- **qwZ** (``zero_quantized_weights``, paper section 3.1): every stage-3 unit all-gather goes through zero_comm's
  ``QuantizedAllGather`` (blockwise symmetric int8, one fp32 scale per ``zeropp_block_size`` elements, default
  4096 = zero_comm's ``DEFAULT_BLOCK``) and is dequantized into the unit's full buffer in the parameter dtype.
  The rank's own shard is dequantized too, not taken exactly, so every rank holds bitwise the same weights
  (a rank using its exact shard would compute with a different model from its peers). The fp32 master shards and
  the stored shards stay exact; only the gathered copy used by forward/backward is quantized. Persistent units are
  re-gathered the same way (also at initialisation) so that every gathered weight went through one path.
  ``GatheredParameters`` and ``ZeroRuntime.full_parameters`` gather exactly (plain all-gather): their values are
  written back or reported, so they must not carry quantization error.
- **qgZ** (``zero_quantized_gradients``, section 3.3): each unit's gradient reduce-scatter goes through zero_comm's
  ``QuantizedReduceScatter`` (int4 by default or int8 via ``zeropp_gradient_bits``; dequantized and summed in
  fp32; averaged over ranks like the plain path). zero_comm's qgZ is synchronous (its second all-to-all needs the
  first one's sums), so with qgZ gradient reduction does not overlap backward. With hpZ its two stages run within
  the hpZ node groups then across them, as the paper; without hpZ one all-to-all stage spans the whole group.
- **hpZ** (``zero_hpz_partition_size`` = k > 1, section 3.2): ranks form nodes of k consecutive ranks
  (``hierarchical_groups``). Each rank holds a *secondary* shard of every unit: its primary chunk concatenated
  over the nodes (one inter-node all-gather per flat group). It is rebuilt synchronously at initialisation, right
  after each optimizer step has written the new shards and after a checkpoint load or a ``GatheredParameters``
  edit, before any gather or prefetch can run (DeepSpeed's asynchronous secondary copy could be read by a
  prefetch before it finished, PR #5216). All unit gathers (forward, backward, prefetch, persistent refresh) then
  run inside the node from the secondary shard; the only inter-node parameter traffic is that rebuild, once per
  step (the paper gathers across nodes in the first forward pass and inside the node afterwards: same volume).
  Without quantization an hpZ gather is bitwise equal to the plain all-gather; with qwZ it quantizes the secondary.

Cost of hpZ: ``num_nodes * shard_numel`` extra elements per rank for the secondary shards.
"""

from __future__ import annotations

import torch

from zero_comm import (
    HierarchicalAllGather,
    QuantizedAllGather,
    QuantizedReduceScatter,
    hierarchical_groups,
)
from zero_core.config import ZeroConfig
from zero_core.layout import Bucket, FlatGroup

QWZ_BITS = 8
"""qwZ weight precision: int8, as ZeRO++ section 3.1."""


def check_zeropp(config: ZeroConfig, world: int) -> None:
    """Raise before any communication when ``zero_hpz_partition_size`` does not divide the world size.

    (Stage < 3 with a ZeRO++ key is rejected by ``ZeroConfig`` itself.)

    Raises:
        ValueError: names the key, the value given and the world size.
    """
    k = config.zero_hpz_partition_size
    if k > 1 and world % k:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size={k} must divide the data-parallel world size {world} "
            f"(hpZ groups ranks into nodes of {k}); use a divisor of {world}"
        )


class ZeroPP:
    """The ZeRO++ collectives of one stage-3 runtime (see the module docstring). Collective construction: every
    rank of ``group`` must build it (hpZ creates the node process groups).

    Args:
        config: the validated ``ZeroConfig`` (stage 3).
        group: the data-parallel process group.
    """

    def __init__(self, config: ZeroConfig, group):
        check_zeropp(config, group.size())
        block, quantizer = config.zeropp_block_size, config.zeropp_quantizer
        k = config.zero_hpz_partition_size
        self.weights_bits = QWZ_BITS if config.zero_quantized_weights else None
        self.groups = hierarchical_groups(group, k) if k > 1 else None
        self.hpz = (
            HierarchicalAllGather(self.groups, bits=self.weights_bits, block=block, quantizer=quantizer)
            if self.groups is not None
            else None
        )
        self.qwz = (
            QuantizedAllGather(group, bits=QWZ_BITS, block=block, quantizer=quantizer)
            if self.weights_bits and self.hpz is None
            else None
        )
        self.qgz = (
            QuantizedReduceScatter(
                self.groups or group, bits=config.zeropp_gradient_bits, block=block, quantizer=quantizer
            )
            if config.zero_quantized_gradients
            else None
        )
        self.secondary: dict[Bucket, torch.Tensor] = {}
        # a plain attribute, not a property: read at every unit gather
        self.gathers_specially = self.hpz is not None or self.qwz is not None
        """True when unit all-gathers go through qwZ or hpZ instead of the plain all-gather."""

    def all_gather(self, b: Bucket, out: torch.Tensor, src: torch.Tensor):
        """Start gathering unit ``b`` into ``out`` (``b.padded_numel`` elements, ``src``'s dtype) from ``src`` (this
        rank's primary chunk, ``b.chunk`` elements); returns the handle (``wait()`` completes dequantization and
        reordering)."""
        if self.hpz is not None:
            return self.hpz(out, self.secondary[b], async_op=True)
        return self.qwz(out, src, async_op=True)

    @torch.no_grad()
    def refresh_secondary(self, flat_groups: list[FlatGroup], shards: list[torch.Tensor]) -> None:
        """hpZ: rebuild every unit's secondary shard from the current stored shards (``shards[g.index]``: the
        stage-3 store's ``shard_numel`` tensor per flat group). Synchronous and collective (one inter-node
        all-gather per flat group); a no-op without hpZ."""
        if self.hpz is None:
            return
        n = self.groups.num_nodes
        for g in flat_groups:
            if g.shard_numel == 0:
                continue
            every = self.hpz.secondary_shard(shards[g.index]).view(n, g.shard_numel)
            for b in g.buckets:
                self.secondary[b] = every[:, b.shard_offset : b.shard_offset + b.chunk].reshape(-1).clone()

    def reduce_scatter(self, out: torch.Tensor, send: torch.Tensor):
        """qgZ: average ``send`` (world x ``out.numel()`` elements) over ranks into ``out``; synchronous, returns a
        completed handle."""
        return self.qgz(out, send, op="avg")
