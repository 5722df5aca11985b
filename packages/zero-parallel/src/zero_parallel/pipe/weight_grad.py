"""Deferred weight gradients for the zero-bubble schedule's split backward.

A stage's ``nn.Linear`` layers (exactly that type, weight requiring gradients) are routed through a
:class:`WeightGradStore`. While it defers, a layer runs through an autograd function that holds its weight and bias
outside the graph: its backward returns the input's gradient only and queues the layer's ``(input, output
gradient)``; the schedule's weight pass later turns the queue into the weights' and biases' gradients
(``grad_output^T @ input`` and ``grad_output`` summed over the leading dimensions, as
``torch.nn.functional.linear``'s backward computes them) through one autograd root, so the parameters' gradient
hooks (the ZeRO reducer's) fire once per weight pass, as in any backward. Not deferring, a layer is the plain
``F.linear``: forward-only runs, 1F1B and evaluation are unchanged. The other parameters (norms, embeddings,
other layer types) get their gradients in the input pass, as in a plain backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _weight_grads(x: torch.Tensor, g: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_weight [out, in], grad_bias [out] or None)`` of ``linear`` from its input ``x [..., in]`` and output
    gradient ``g [..., out]``."""
    g2 = g.reshape(-1, g.shape[-1])
    gw = g2.t().mm(x.reshape(-1, x.shape[-1]))
    return gw, (g2.sum(0) if has_bias else None)


class WeightGradStore:
    """The queue of one input pass's Linear work: ``(weight, bias, input, output gradient)`` per call.

    :meth:`install` reroutes a module's Linear layers; while :attr:`deferring` (set by the executor for a split
    backward's batch, forward included) they run with their parameters outside the autograd graph (so no gradient
    hook of theirs fires in the input pass) and their backward queues the weight work; :meth:`start` opens a queue
    and :meth:`take` hands it over (to be run by :func:`weight_root`). Not deferring, the layers are plain Linear."""

    def __init__(self) -> None:
        self.deferring = False
        self.queue: list[tuple[nn.Parameter, nn.Parameter | None, torch.Tensor, torch.Tensor]] = []
        # a leaf that keeps a deferred layer's output in the graph when its input needs no gradient (a first stage)
        self.anchor = torch.zeros((), requires_grad=True)

    def install(self, module: nn.Module) -> int:
        """Route every ``nn.Linear`` of ``module`` (exact type, weight requiring gradients) through this store;
        returns how many. A layer's forward hooks still run (only its ``forward`` is replaced)."""
        count = 0
        for layer in module.modules():
            if type(layer) is nn.Linear and layer.weight.requires_grad:
                layer.forward = _DeferringForward(layer, self)
                count += 1
        return count

    def start(self) -> None:
        """Open a queue: the input pass's Linear backwards add their weight work to it."""
        self.queue = []

    def take(self) -> list:
        """Return the queue (and start an empty one)."""
        queue, self.queue = self.queue, []
        return queue


class _DeferringForward:
    """A Linear layer's replacement ``forward``: plain ``F.linear``, or :class:`_DeferredLinear` while the store
    defers."""

    __slots__ = ("layer", "store")

    def __init__(self, layer: nn.Linear, store: WeightGradStore) -> None:
        self.layer = layer
        self.store = store

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer, store = self.layer, self.store
        if not store.deferring or not torch.is_grad_enabled():
            return F.linear(x, layer.weight, layer.bias)
        return _DeferredLinear.apply(x, store.anchor, layer, store)  # the layer, not its tensors: no edges


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose parameters are no autograd inputs: its backward returns the input's gradient and queues
    the weight work in the store."""

    @staticmethod
    def forward(ctx, x, anchor, layer, store):
        ctx.save_for_backward(x)
        ctx.params = (layer.weight, layer.bias)
        ctx.store = store
        return F.linear(x, layer.weight.detach(), layer.bias.detach() if layer.bias is not None else None)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        gx = g.matmul(weight.detach()) if ctx.needs_input_grad[0] else None
        ctx.store.queue.append((weight, bias, x.detach(), g.detach()))
        return gx, None, None, None


class _WeightRoot(torch.autograd.Function):
    """A zero scalar whose backward hands ``weight`` and ``bias`` their gradients from a queued ``(x, g)``
    (times the root's own gradient, which the weight pass makes exactly one)."""

    @staticmethod
    def forward(ctx, x, g, weight, bias):
        ctx.save_for_backward(x, g)
        ctx.has_bias = bias is not None
        return weight.new_zeros(())

    @staticmethod
    def backward(ctx, scale):
        x, g = ctx.saved_tensors
        gw, gb = _weight_grads(x, g, ctx.has_bias)
        gw = gw * scale.to(gw.dtype)
        gb = gb * scale.to(gb.dtype) if gb is not None else None
        return None, None, gw, gb


def weight_root(queue: list) -> torch.Tensor | None:
    """One scalar (zero) whose backward gives every queued weight (and bias) its gradient; None for an empty
    queue."""
    roots = [_WeightRoot.apply(x, g, w, b) for w, b, x, g in queue]
    return sum(roots[1:], roots[0]) if roots else None
