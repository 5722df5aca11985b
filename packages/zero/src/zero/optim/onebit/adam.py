"""1-bit Adam (Tang et al. 2021, arXiv 2102.02888, Algorithm 1) with DeepSpeed's ``OnebitAdam`` parameters."""

from __future__ import annotations

import torch

from zero.optim.closure import loss_of
from zero.optim.onebit.base import CompressedOptimizer


class OneBitAdam(CompressedOptimizer):
    """Adam for ``freeze_step`` steps (gradients all-reduced in full precision), then the variance is frozen and
    only the momentum is communicated, through the 1-bit compressed all-reduce with error feedback.

    Per tensor, with ``g`` the gradient (averaged over ranks during warm-up, this rank's own afterwards):
    warm-up ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``; compressed phase ``m = b1 m + (1 - b1) g``,
    then ``m = compressed_all_reduce(m)`` (``v`` unchanged); both ``p -= lr * (m / (sqrt(v) + eps) + wd * p)``
    (``eps_inside_sqrt``: ``sqrt(v + eps)``). As DeepSpeed's OnebitAdam, no bias correction is applied
    (``bias_correction`` is accepted and ignored) and weight decay is added to the update. Unlike it, the first
    ``step()`` updates the parameters (DeepSpeed's first call only initializes its buffers).

    Args:
        params: tensors or param-group dicts. lr, betas, eps, eps_inside_sqrt, weight_decay: as above.
        freeze_step: warm-up steps (>= 0) before compression starts.

    State per tensor: ``exp_avg``, ``exp_avg_sq``; after warm-up ``worker_error`` and ``server_error`` (fp32,
    the tensor's numel rounded up to a multiple of 8 x world, and that over world).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                        weight_decay=weight_decay, bias_correction=bias_correction)  # fmt: skip
        super().__init__(params, defaults)
        if freeze_step < 0:
            raise ValueError(f"OneBitAdam: freeze_step must be >= 0, got {freeze_step}")
        self.freeze_step = freeze_step

    @property
    def reduce_gradients(self) -> bool:
        """Full-precision gradient all-reduce during the ``freeze_step`` warm-up steps only."""
        return self.steps < self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every tensor with a ``.grad``; collective after warm-up (every rank must call it)."""
        loss = loss_of(closure)
        warmup = self.reduce_gradients
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m, v = self._state(p, state)
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                if warmup:
                    v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                else:
                    m.copy_(self._all_reduce_1bit(m, state))
                update = m / self._denom(v, group)
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
        self.steps += 1
        return loss
