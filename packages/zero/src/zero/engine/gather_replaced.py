"""``GatherReplacedLayerParams`` (DeepSpeed 0.19.8's ``deepspeed.module_inject.layers``): inside the block, the named
parameters of a layer AutoTP split over its tensor-parallel group hold their full tensors; on exit each rank keeps
its shard of the (possibly edited) full tensor again.

DeepSpeed marks the parameters of its replaced layers; zero's AutoTP layers are ``zero_parallel``'s
``ColumnParallelLinear`` / ``RowParallelLinear``, and each split parameter's layout is recorded for the model it
belongs to (``zero_parallel.layout_of``), found through the live engine that holds the parameter. For any other
module, or a parameter no engine splits, the block does nothing (DeepSpeed disables it the same way).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from zero_core import ZeroRuntime, registry
from zero_parallel import layout_of
from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, ShardLayout


def _layout(param: torch.Tensor) -> tuple[ShardLayout, object, int] | None:
    """``(layout, tensor-parallel group, rank in it)`` of a split parameter of a live engine's model, else None."""
    found = registry.lookup(param)
    if found is None or not isinstance(found.owner, ZeroRuntime):
        return None
    model = found.owner.module
    split = layout_of(model)
    if split is None or id(param) not in split.sharded_ids:
        return None
    name = next(n for n, p in model.named_parameters(remove_duplicate=False) if p is param)
    return split.shards[name], split.group, split.rank


def _gather(shard: torch.Tensor, layout: ShardLayout, group) -> torch.Tensor:
    """The full tensor from every rank's shard (widths may differ along ``layout.dim``: padded for the all-gather)."""
    size = dist.get_world_size(group)
    widths = [layout.rank_width(r) for r in range(size)]
    shape = list(shard.shape)
    shape[layout.dim] = max(widths)
    padded = torch.zeros(shape, dtype=shard.dtype, device=shard.device)
    padded.narrow(layout.dim, 0, shard.shape[layout.dim]).copy_(shard)
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return layout.unshard([g.narrow(layout.dim, 0, w) for g, w in zip(gathered, widths)])


class GatherReplacedLayerParams:
    """Context manager: full tensors of AutoTP-split ``params`` of ``module`` inside, shards again on exit.

    Mirrors ``deepspeed.module_inject.layers.GatherReplacedLayerParams(params, module, enabled=True)``. Collective
    over the tensor-parallel group: every rank of it enters with the same parameters. At ZeRO stage 3 enter it
    inside ``zero.GatheredParameters`` over the same parameters (each rank's tensor-parallel shard gathered over its
    data-parallel ranks first; with ``modifier_rank`` an edit inside reaches the stored partitions and the fp32
    master weights), as DeepSpeed nests them. An edit of the full tensor
    inside reaches each rank's shard (the 16-bit parameter; call ``engine.optimizer.refresh_fp32_params()`` for the
    fp32 master weights).

    Args:
        params: a parameter or an iterable of parameters.
        module: the layer they belong to; a layer AutoTP did not replace leaves the block disabled.
        enabled: False: no-op.

    Raises:
        RuntimeError: on entry, a split parameter still partitioned by ZeRO stage 3 (not inside
            ``zero.GatheredParameters``).
    """

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], module: torch.nn.Module, enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.module = module
        self.enabled = enabled and isinstance(module, ColumnParallelLinear | RowParallelLinear)
        self._held: list[tuple[torch.Tensor, ShardLayout, int, torch.Tensor]] = []

    def __enter__(self) -> None:
        if not self.enabled:
            return
        for param in self.params:
            found = _layout(param)
            if found is None:
                continue
            layout, group, rank = found
            local = param.data
            want = list(layout.full_shape)
            want[layout.dim] = layout.rank_width(rank)
            if list(local.shape) != want:  # partitioned over data-parallel ranks by ZeRO-3, not gathered
                raise RuntimeError(f"GatherReplacedLayerParams: parameter of shape {tuple(want)} (this rank's "
                                   f"tensor-parallel shard) is partitioned by ZeRO stage 3 (local shape "
                                   f"{tuple(local.shape)}); enter zero.GatheredParameters over it first, as "
                                   "DeepSpeed's consolidated save does")  # fmt: skip
            full = _gather(local, layout, group)
            self._held.append((param, layout, rank, local))
            param.data = full

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        with torch.no_grad():
            for param, layout, rank, local in self._held:
                local.copy_(layout.shard(param.data, rank))  # the shard's own storage (the engine's flat buffer)
                param.data = local
        self._held.clear()
