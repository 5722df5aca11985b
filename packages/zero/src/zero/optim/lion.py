"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", arXiv 2302.06675, Algorithm 2).

torch has no Lion; this is ours, with DeepSpeed's ``FusedLion``/``DeepSpeedCPULion`` arguments and defaults
(``lr=1e-3, betas=(0.9, 0.999), weight_decay=0``). Every operation is element-wise, so it steps a ZeRO shard
exactly as it would the full tensor (any stage).
"""

from __future__ import annotations

import torch

from zero.optim.closure import loss_of


class Lion(torch.optim.Optimizer):
    """Sign of an interpolated momentum, with decoupled weight decay. Per element, for gradient ``g``:

    ``p *= 1 - lr * weight_decay``; ``p -= lr * sign(beta1 * m + (1 - beta1) * g)``;
    ``m = beta2 * m + (1 - beta2) * g``. State: ``exp_avg`` (``m``, the parameter's shape and dtype).

    Args:
        params: tensors or param-group dicts.
        lr: step size (> 0). betas: ``(beta1, beta2)`` in [0, 1). weight_decay: decoupled decay (>= 0).

    Raises:
        ValueError: an argument out of range, naming it.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0):
        if lr <= 0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        if weight_decay < 0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a ``.grad``; returns ``closure()`` when given."""
        loss = loss_of(closure)
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(m * b1 + g * (1 - b1)), alpha=-lr)
                m.mul_(b2).add_(g, alpha=1 - b2)
        return loss
