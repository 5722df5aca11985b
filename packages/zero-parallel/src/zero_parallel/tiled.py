"""Sequence-tiled compute: run a per-token computation one tile of the sequence at a time, so that only one tile's
intermediates are alive (Arctic Long Sequence Training's memory tools; DeepSpeed 0.19.8's ``TiledMLP``,
``TiledFusedLogitsLoss`` and ``SequenceTiledCompute`` in ``deepspeed/runtime/sequence_parallel/ulysses_sp.py``).

The forward keeps no graph: each tile runs under ``no_grad`` and only the input is saved. The backward runs each
tile again with autograd on and takes its gradients at once (``torch.autograd.grad``), so one tile's graph exists
at a time. ``TiledFusedLogitsLoss`` is the last computation of a step, so it takes the gradients in its forward
instead (the logits of one tile at a time, never the whole ``[b, s, vocab]`` tensor) and its backward only scales
what it kept.

Parameters get one gradient per call, not one per tile: the tiles' gradients of every trainable leaf the tiles use
(found in the tile's graph; the caller's ``compute_params`` need not list them) are summed and then accumulated
into ``.grad`` through autograd (``torch.autograd.backward`` on the parameters), so post-accumulate hooks such as
a ZeRO or DDP gradient reducer fire once per parameter per call (DeepSpeed instead marks ``ds_grad_is_ready``).

Under ZeRO-3 the ``compute_params`` (every parameter the computation reads, frozen ones included) must be gathered
for the call: a class's :attr:`gather` (a :class:`ParamGather`) holds them gathered around all tiles of the forward
and again around all tiles of the backward, so each is gathered once per pass, not once per tile, and the number of
tiles may differ between ranks. The default gathers nothing (whole parameters); the ``zero`` package serves
subclasses bound to its stage-3 store at DeepSpeed's module path.

Tiles split the sequence dimension as ``torch.tensor_split`` does: ``shards`` tiles (at most one per position),
sizes differing by at most one. Inputs a tile function gets through its arguments are detached in the backward's
recompute; tensors it captures other than parameters (leaves) must not require grad.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = [
    "ParamGather",
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "no_gather",
    "sequence_tiled_compute",
    "tile_bounds",
]

REDUCTIONS = ("mean", "sum")


class ParamGather(Protocol):
    """Gathers parameters for the duration of a ``with`` block: ``gather(params)`` returns a context manager inside
    which every tensor of ``params`` holds its whole value (ZeRO-3: all-gathered once, released on exit). Collective
    when the parameters are partitioned: every rank enters with the same parameters in the same order."""

    def __call__(self, params: Sequence[torch.Tensor]) -> AbstractContextManager[Any]: ...


def no_gather(params: Sequence[torch.Tensor]) -> AbstractContextManager[Any]:
    """The :class:`ParamGather` for whole parameters: nothing to gather."""
    return contextlib.nullcontext()


def tile_bounds(length: int, shards: int) -> list[tuple[int, int]]:
    """``(start, size)`` of each tile of ``length`` positions in ``shards`` tiles, as ``torch.tensor_split``:
    ``min(shards, length)`` tiles (one empty tile when ``length`` is 0), the first ``length % n`` one longer.

    Raises:
        ValueError: ``shards`` is not a positive integer.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"shards must be a positive integer, got {shards!r}")
    n = max(1, min(shards, length))
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        bounds.append((start, size))
        start += size
    return bounds


def _params_list(compute_params, name: str) -> list[torch.Tensor]:
    """``compute_params`` (None, a tensor or an iterable of tensors) as a list without repeats."""
    if compute_params is None:
        return []
    if isinstance(compute_params, torch.Tensor):
        compute_params = [compute_params]
    out, seen = [], set()
    for i, p in enumerate(compute_params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name}: compute_params[{i}] must be a tensor (a parameter), got {type(p).__name__}")
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _graph_leaves(outputs: Sequence[torch.Tensor], skip: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaves requiring grad that ``outputs`` were computed from (``AccumulateGrad`` nodes), less ``skip``."""
    skip_ids = {id(t) for t in skip}
    leaves, seen_nodes, seen_leaves = [], set(), set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        if type(node).__name__ == "AccumulateGrad":
            var = node.variable
            if id(var) not in skip_ids and id(var) not in seen_leaves:
                seen_leaves.add(id(var))
                leaves.append(var)
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves


def _anchor(inputs_need_grad: bool, compute_params, params: list[torch.Tensor]) -> torch.Tensor | None:
    """An empty leaf requiring grad, given to the autograd function so that its output requires grad when only
    parameters do (the tiles' parameters are not its inputs): when grad is enabled, the tensor inputs need no
    gradient and a listed parameter requires grad, or ``compute_params`` is None (the parameters are unknown)."""
    if not torch.is_grad_enabled() or inputs_need_grad:
        return None
    if compute_params is None or any(p.requires_grad for p in params):
        return torch.empty(0, requires_grad=True)
    return None


class _ParamGrads:
    """Per-call sums of the tiles' parameter gradients, keyed by the leaf; ``accumulate`` hands each to autograd
    once (into ``.grad``, firing its hooks)."""

    def __init__(self):
        self.leaves: list[torch.Tensor] = []
        self.sums: list[torch.Tensor] = []
        self.index: dict[int, int] = {}

    def tile(self, outputs, grads, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """Backward of one tile: returns the gradients of ``inputs`` and adds those of every other leaf to the sums."""
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
        if not pairs:
            return [None] * len(inputs)
        outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        leaves = _graph_leaves(outputs, inputs)
        for leaf in leaves:
            if id(leaf) not in self.index:
                self.index[id(leaf)] = len(self.leaves)
                self.leaves.append(leaf)
                self.sums.append(None)
        wanted = [t for t in inputs if t.requires_grad]
        got = torch.autograd.grad(outputs, wanted + leaves, grads, allow_unused=True)
        for leaf, g in zip(leaves, got[len(wanted) :]):
            if g is not None:
                i = self.index[id(leaf)]
                self.sums[i] = g if self.sums[i] is None else self.sums[i].add_(g)
        it = iter(got[: len(wanted)])
        return [next(it) if t.requires_grad else None for t in inputs]

    def scale(self, factor: torch.Tensor) -> None:
        """Multiply every sum by ``factor`` (the incoming gradient of a scalar output)."""
        self.sums = [s if s is None else s.mul_(factor) for s in self.sums]

    def accumulate(self) -> None:
        """Each leaf's sum into its ``.grad`` through autograd (one accumulation, hooks fire once)."""
        pairs = [(p, g) for p, g in zip(self.leaves, self.sums) if g is not None]
        self.leaves, self.sums, self.index = [], [], {}
        if pairs:
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])


# ---------------------------------------------------------------------------------------------------- TiledMLP
class _TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, x, shards, gather, params, anchor):
        ctx.fn, ctx.module, ctx.gather, ctx.params = fn, module, gather, params
        ctx.bounds = tile_bounds(x.shape[-2], shards)
        ctx.save_for_backward(x)
        outs = [fn(module, x.narrow(-2, start, size)) for start, size in ctx.bounds]
        return torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach()
        x_grad = torch.zeros_like(x) if ctx.needs_input_grad[2] else None
        acc = _ParamGrads()
        with ctx.gather(ctx.params):
            for start, size in ctx.bounds:
                tile = x.narrow(-2, start, size).requires_grad_(x_grad is not None)
                with torch.enable_grad():
                    out = ctx.fn(ctx.module, tile)
                (g,) = acc.tile([out], [grad_out.narrow(-2, start, size)], [tile])
                if g is not None:
                    x_grad.narrow(-2, start, size).copy_(g)
            acc.accumulate()
        return None, None, x_grad, None, None, None, None


class TiledMLP:
    """A per-token module (an MLP) over ``x`` ``[..., s, h]`` one sequence tile at a time (DeepSpeed's
    ``TiledMLP``): ``TiledMLP.apply(fn, self, x, shards, compute_params)`` returns ``fn(self, x)``'s value
    (``[..., s, h_out]``, same dtype and device), computed per tile of dim ``-2``. Its backward recomputes one tile
    at a time (the forward runs twice). ``compute_params`` lists the parameters ``fn`` reads (needed under ZeRO-3,
    else may be None); see the module docstring for gathering and gradients.

    Raises:
        ValueError: ``shards`` not a positive integer; ``x`` with fewer than 2 dimensions.
        TypeError: an entry of ``compute_params`` is not a tensor.
    """

    gather: ParamGather = staticmethod(no_gather)

    @classmethod
    def apply(cls, fn: Callable, self: torch.nn.Module, x: torch.Tensor, shards: int, compute_params=None):
        if x.dim() < 2:
            raise ValueError(f"TiledMLP: x must be [..., seq, hidden], got shape {tuple(x.shape)}")
        tile_bounds(x.shape[-2], shards)
        params = _params_list(compute_params, "TiledMLP")
        with cls.gather(params):
            anchor = _anchor(x.requires_grad, compute_params, params)
            return _TiledMLPFunction.apply(fn, self, x, shards, cls.gather, params, anchor)


# --------------------------------------------------------------------------------------- TiledFusedLogitsLoss
class _TiledLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, x, y, mask, shards, reduction, with_grad, params_grads, gather, params, anchor):
        bs, seqlen = x.shape[:2]
        bounds = tile_bounds(bs * seqlen, shards)
        xf = x.detach().reshape(bs * seqlen, *x.shape[2:])
        yf = y.reshape(bs * seqlen, *y.shape[2:])
        mf = None if mask is None else mask.reshape(bs * seqlen)
        weight = 1.0 / len(bounds) if reduction == "mean" else 1.0
        x_grad = torch.zeros_like(xf) if with_grad and ctx.needs_input_grad[2] else None
        losses = []
        for start, size in bounds:
            tile = xf.narrow(0, start, size).requires_grad_(x_grad is not None)
            args = (module, tile, yf.narrow(0, start, size))
            if mf is not None:
                args += (mf.narrow(0, start, size),)
            with torch.enable_grad() if with_grad else contextlib.nullcontext():
                loss = fn(*args)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"TiledFusedLogitsLoss: fn must return a 1-element loss tensor, got {loss!r}")
            if with_grad:
                grad = torch.full_like(loss, weight)
                (g,) = params_grads.tile([loss], [grad], [tile])
                if g is not None:
                    x_grad.narrow(0, start, size).copy_(g)
            losses.append(loss.detach().reshape(()))
        ctx.acc, ctx.gather, ctx.params = params_grads, gather, params
        ctx.x_grad = None if x_grad is None else x_grad.view(x.shape)
        stacked = torch.stack(losses)
        return stacked.mean() if reduction == "mean" else stacked.sum()

    @staticmethod
    def backward(ctx, grad_out):
        x_grad = ctx.x_grad
        if x_grad is not None:
            x_grad = x_grad * grad_out
        acc = ctx.acc
        if acc is not None and acc.leaves:
            acc.scale(grad_out)
            with ctx.gather(ctx.params):
                acc.accumulate()
        ctx.x_grad, ctx.acc = None, None
        return (None, None, x_grad) + (None,) * 9


class TiledFusedLogitsLoss:
    """A loss over the logits of ``x`` (hidden states ``[b, s, ...]``) computed one tile of the ``b * s`` positions at
    a time, never holding the whole logits tensor (DeepSpeed's ``TiledFusedLogitsLoss``):
    ``TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params, output_reduction)`` returns the
    ``"mean"`` or ``"sum"`` over tiles of ``fn(self, x_tile, y_tile[, mask_tile])`` (a 1-element loss; ``mask``
    passed only when not None), a 0-dim tensor. ``y`` ``[b, s, ...]`` and ``mask`` ``[b, s]`` are tiled with ``x``.
    The gradients are taken in the forward, tile by tile (with grad enabled and something requiring grad); backward
    scales them by the incoming gradient and accumulates the parameters' (one accumulation per call). Note that
    ``"mean"`` is the mean of the tiles' losses, equal to the mean over positions only when the tiles count the same
    positions: with uneven tiles or a mask, use ``"sum"`` and divide by the counted positions (as DeepSpeed).

    Raises:
        ValueError: ``output_reduction`` not "mean"/"sum"; ``x`` or ``y`` under 2 dims, their ``[b, s]`` differing;
            ``mask`` not ``[b, s]``; ``shards`` not a positive integer; ``fn`` not returning a 1-element tensor.
        TypeError: an entry of ``compute_params`` is not a tensor.
    """

    gather: ParamGather = staticmethod(no_gather)

    @classmethod
    def apply(cls, fn, self, x, y, mask, shards, compute_params=None, output_reduction="mean"):
        if output_reduction not in REDUCTIONS:
            raise ValueError(
                f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {output_reduction!r}"
            )
        if x.dim() < 2 or y.dim() < 2:
            raise ValueError(
                f"TiledFusedLogitsLoss: x and y must be [batch, seq, ...], got {tuple(x.shape)} and {tuple(y.shape)}"
            )
        if x.shape[:2] != y.shape[:2]:
            raise ValueError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} differ in [batch, seq]")
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"TiledFusedLogitsLoss: mask must be {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        tile_bounds(x.shape[0] * x.shape[1], shards)
        params = _params_list(compute_params, "TiledFusedLogitsLoss")
        anchor = _anchor(x.requires_grad, compute_params, params)
        with_grad = torch.is_grad_enabled() and (x.requires_grad or anchor is not None)
        acc = _ParamGrads() if with_grad else None
        with cls.gather(params):
            return _TiledLossFunction.apply(
                fn, self, x, y, mask, shards, output_reduction, with_grad, acc, cls.gather, params, anchor
            )


# -------------------------------------------------------------------------------------- SequenceTiledCompute
class _SequenceTiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_key, gather, params, out_dim, reduction,
                anchor, *args):  # fmt: skip
        sharded = dict(zip(keys_to_shard, args[: len(keys_to_shard)]))
        passed = dict(zip(keys_to_pass, args[len(keys_to_shard) :]))
        bounds = tile_bounds(seqlen, shards)
        outs = [fn(**{k: v.narrow(1, s, n) for k, v in sharded.items()}, **passed) for s, n in bounds]
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"SequenceTiledCompute: fn must return a tensor, tile {i} returned {type(o).__name__}")
        if out_dim == 0:
            outs = [o.unsqueeze(0) for o in outs]
        full = torch.cat(outs, dim=out_dim)
        ctx.fn, ctx.bounds, ctx.gather, ctx.params = fn, bounds, gather, params
        ctx.keys_to_shard, ctx.keys_to_pass, ctx.grad_key = keys_to_shard, keys_to_pass, grad_key
        ctx.out_dim, ctx.reduction, ctx.full_shape = out_dim, reduction, full.shape
        ctx.out_sizes = [o.shape[out_dim] for o in outs]
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        if reduction == "mean":
            return full.mean()
        return full.sum() if reduction == "sum" else full

    @staticmethod
    def backward(ctx, grad_out):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t.detach()
        n_shard = len(ctx.keys_to_shard)
        sharded = dict(zip(ctx.keys_to_shard, args[:n_shard]))
        passed = dict(zip(ctx.keys_to_pass, args[n_shard:]))
        if ctx.reduction == "mean":
            grad_full = (grad_out / max(1, _numel(ctx.full_shape))).expand(ctx.full_shape)
        elif ctx.reduction == "sum":
            grad_full = grad_out.expand(ctx.full_shape)
        else:
            grad_full = grad_out
        in_index = (ctx.keys_to_shard + ctx.keys_to_pass).index(ctx.grad_key)
        wants = ctx.needs_input_grad[11 + in_index] and ctx.grad_key in sharded
        base = sharded[ctx.grad_key] if ctx.grad_key in sharded else None
        in_grad = torch.zeros_like(base) if wants else None
        acc = _ParamGrads()
        out_at = 0
        with ctx.gather(ctx.params):
            for i, (start, size) in enumerate(ctx.bounds):
                tiles = {k: v.narrow(1, start, size) for k, v in sharded.items()}
                if wants:
                    tiles[ctx.grad_key] = tiles[ctx.grad_key].requires_grad_()
                with torch.enable_grad():
                    out = ctx.fn(**tiles, **passed)
                if ctx.out_dim == 0:
                    g_tile = grad_full[i].reshape(out.shape)
                else:
                    g_tile = grad_full.narrow(ctx.out_dim, out_at, ctx.out_sizes[i])
                    out_at += ctx.out_sizes[i]
                inputs = [tiles[ctx.grad_key]] if wants else []
                got = acc.tile([out], [g_tile], inputs)
                if wants and got[0] is not None:
                    in_grad.narrow(1, start, size).copy_(got[0])
            acc.accumulate()
        grads = [None] * len(args)
        if wants:
            grads[in_index] = in_grad
        return (None,) * 11 + tuple(grads)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SequenceTiledCompute:
    """Any computation over sequence-sharded keyword inputs, one tile of dim 1 at a time, recomputed tile by tile in
    backward (DeepSpeed's ``SequenceTiledCompute``; :func:`sequence_tiled_compute` is its keyword form).

    ``SequenceTiledCompute.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key,
    compute_params, output_unshard_dimension, output_reduction, *args)``: ``args`` holds the values of
    ``keys_to_shard`` (each ``[b, seqlen, ...]``, tiled on dim 1) then of ``keys_to_pass`` (given whole to each
    call). ``fn(**tile_kwargs, **passed)`` must return a tensor; the tiles' outputs are concatenated on
    ``output_unshard_dimension`` (0: stacked, e.g. one loss per tile), then reduced by ``output_reduction``
    (None, "mean" or "sum" over all elements). Only ``grad_requiring_tensor_key`` (one of ``keys_to_shard``) gets
    an input gradient; parameters ``fn`` uses get theirs once per call (see the module docstring).

    Raises:
        ValueError: ``output_reduction`` unknown; ``grad_requiring_tensor_key`` not among ``keys_to_shard``; a
            sharded value not a tensor of at least 2 dims with ``seqlen`` positions on dim 1; the number of ``args``
            not matching the keys; ``shards`` not a positive integer.
        TypeError: an entry of ``compute_params`` is not a tensor; ``fn`` not returning a tensor.
    """

    gather: ParamGather = staticmethod(no_gather)

    @classmethod
    def apply(cls, fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_requiring_tensor_key, compute_params,
              output_unshard_dimension, output_reduction, *args):  # fmt: skip
        keys_to_shard, keys_to_pass = list(keys_to_shard), list(keys_to_pass)
        if output_reduction not in (None, *REDUCTIONS):
            raise ValueError(f"SequenceTiledCompute: output_reduction must be None, 'mean' or 'sum', got "
                             f"{output_reduction!r}")  # fmt: skip
        if grad_requiring_tensor_key not in keys_to_shard:
            raise ValueError(f"SequenceTiledCompute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} must be "
                             f"one of keys_to_shard {keys_to_shard}")  # fmt: skip
        if len(args) != len(keys_to_shard) + len(keys_to_pass):
            raise ValueError(f"SequenceTiledCompute: {len(args)} values for {len(keys_to_shard)} keys to shard and "
                             f"{len(keys_to_pass)} keys to pass")  # fmt: skip
        for k, v in zip(keys_to_shard, args):
            if not isinstance(v, torch.Tensor) or v.dim() < 2 or v.shape[1] != seqlen:
                shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                raise ValueError(f"SequenceTiledCompute: {k!r} must be a tensor [batch, {seqlen}, ...], got {shape}")
        tile_bounds(seqlen, shards)
        params = _params_list(compute_params, "SequenceTiledCompute")
        inputs_need_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        anchor = _anchor(inputs_need_grad, compute_params, params)
        with cls.gather(params):
            return _SequenceTiledFunction.apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
                                                grad_requiring_tensor_key, cls.gather, params,
                                                output_unshard_dimension, output_reduction, anchor, *args)  # fmt: skip


def sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard: dict, kwargs_to_pass: dict, grad_requiring_tensor_key,
                           compute_params=None, output_unshard_dimension=1, output_reduction="mean",
                           tiler: type[SequenceTiledCompute] = SequenceTiledCompute):  # fmt: skip
    """:class:`SequenceTiledCompute` with its inputs as two dicts (DeepSpeed's ``sequence_tiled_compute``; defaults
    ``output_unshard_dimension=1``, ``output_reduction="mean"``). ``tiler`` picks the class (its ``gather``).
    Returns what ``SequenceTiledCompute.apply`` returns; raises what it raises."""
    return tiler.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass), grad_requiring_tensor_key,
                       compute_params, output_unshard_dimension, output_reduction, *kwargs_to_shard.values(),
                       *kwargs_to_pass.values())  # fmt: skip
