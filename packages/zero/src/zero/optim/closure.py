"""The ``step(closure)`` prologue every zero optimizer shares (torch's ``Optimizer.step`` contract)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def loss_of(closure: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
    """``closure()`` evaluated with gradients enabled (steps run under ``torch.no_grad``), or None without one:
    torch's optimizers re-evaluate the model this way before their update."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
