"""Column- and row-parallel ``Linear`` layers and the shard arithmetic behind them (DeepSpeed's ``LinearLayer``
and ``LinearAllreduce`` for AutoTP training).

A replaced layer keeps the ``Linear``'s own ``nn.Parameter`` objects, narrowed in place to this rank's shard, so an
optimizer built over the model before the split keeps pointing at the parameters it steps and ``state_dict`` keys
are unchanged (``weight``, ``bias``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_parallel.tp_comm import column_parallel_linear, gather_last_dim, reduce_from_tp


def even_sizes(total: int, parts: int, unit: int = 1) -> tuple[int, ...]:
    """``total`` split into ``parts`` shards of whole ``unit``-sized blocks, the first ranks taking one block more
    when the blocks do not divide evenly (DeepSpeed's ``get_shard_size``). Raises ValueError when ``unit`` does not
    divide ``total``."""
    if total % unit:
        raise ValueError(f"{total} elements cannot be split into blocks of {unit}")
    blocks = total // unit
    return tuple((blocks // parts + (1 if r < blocks % parts else 0)) * unit for r in range(parts))


@dataclass(frozen=True)
class ShardLayout:
    """How one parameter is split over the tensor-parallel group.

    Attributes:
        name: the parameter's name in the model.
        dim: the split dim of the full tensor.
        full_shape: the full tensor's shape.
        sizes: ``sizes[s][r]``: elements along ``dim`` of sub-parameter ``s`` that rank ``r`` holds; a rank's
            shard is the concatenation of its pieces of every sub-parameter, in order.
    """

    name: str
    dim: int
    full_shape: tuple[int, ...]
    sizes: tuple[tuple[int, ...], ...]

    def rank_width(self, rank: int) -> int:
        """Elements along ``dim`` that ``rank`` holds."""
        return sum(sub[rank] for sub in self.sizes)

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s shard of ``full`` (a new contiguous tensor)."""
        pieces, start = [], 0
        for sub in self.sizes:
            pieces.append(full.narrow(self.dim, start + sum(sub[:rank]), sub[rank]))
            start += sum(sub)
        return torch.cat(pieces, self.dim).contiguous()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (in rank order): the inverse of :meth:`shard`."""
        pieces = []
        offsets = [0] * len(shards)
        for sub in self.sizes:
            for r, shard in enumerate(shards):
                pieces.append(shard.narrow(self.dim, offsets[r], sub[r]))
                offsets[r] += sub[r]
        return torch.cat(pieces, self.dim)


def _narrow_in_place(param: torch.nn.Parameter, layout: ShardLayout, rank: int) -> None:
    with torch.no_grad():
        param.data = layout.shard(param.data, rank)


class ColumnParallelLinear(torch.nn.Module):
    """A ``Linear`` whose output features are split over ``group``: ``y_shard = x @ W_shard.T + b_shard``.

    The input ``[..., in_features]`` is the same on every rank; the output is ``[..., local out features]``, or
    ``[..., out_features]`` on every rank with ``gather_output`` (an all-gather in forward). Backward sums the
    input's gradient over the group (``overlap``: while the weight gradient is computed).

    ``collectives_in_graph`` (set by a compiler that inserts the collectives in its graph itself, zero_compile's
    autotp pass): while ``torch.compile`` traces, forward is the plain local ``linear``, without the backward
    all-reduce or the gather; eager calls keep them.
    """

    def __init__(self, linear: torch.nn.Linear, layout: ShardLayout, bias_layout: ShardLayout | None, group,
                 rank: int, gather_output: bool = False, overlap: bool = False):  # fmt: skip
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.overlap = overlap
        self.collectives_in_graph = False
        self.in_features = linear.in_features
        self.out_features = layout.rank_width(rank)  # this rank's output features
        self.widths = tuple(layout.rank_width(r) for r in range(len(layout.sizes[0])))  # every rank's, for gather
        _narrow_in_place(linear.weight, layout, rank)
        if linear.bias is not None:
            _narrow_in_place(linear.bias, bias_layout, rank)
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` (local, or all of them with ``gather_output``)."""
        if self.collectives_in_graph and torch.compiler.is_compiling():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = column_parallel_linear(x, self.weight, self.bias, self.group, self.overlap)
        return gather_last_dim(y, self.group, self.widths) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, local_out_features={self.out_features}, gather={self.gather_output}"


class RowParallelLinear(torch.nn.Module):
    """A ``Linear`` whose input features are split over ``group``: ``y = sum_r x_r @ W_r.T + b``.

    The input is ``[..., local in features]`` (a column-parallel layer's output); the output ``[..., out_features]``
    is all-reduced in forward and the same on every rank; the bias stays whole and is added once, after the sum.
    ``collectives_in_graph``: while ``torch.compile`` traces, the local product is not summed here (the compiler's
    graph sums it before the bias); eager calls sum it.
    """

    def __init__(self, linear: torch.nn.Linear, layout: ShardLayout, group, rank: int):
        super().__init__()
        self.group = group
        self.in_features = layout.rank_width(rank)  # this rank's input features
        self.out_features = linear.out_features
        self.collectives_in_graph = False
        _narrow_in_place(linear.weight, layout, rank)
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., local in features]`` -> ``[..., out_features]``, summed over the group."""
        y = torch.nn.functional.linear(x, self.weight)
        if not (self.collectives_in_graph and torch.compiler.is_compiling()):
            y = reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local_in_features={self.in_features}, out_features={self.out_features}"
