"""Pure-torch Adam/AdamW step with the same contract as the C++ op: the fallback and the tests' reference."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def adam_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    bf16_out: torch.Tensor | None = None,
) -> None:
    """One Adam (L2) or AdamW (decoupled) step in place, written with torch ops.

    Same formula and order as ``torch.optim.Adam``/``AdamW``'s single-tensor path; ``grad_scale`` multiplies the
    gradient first (without modifying ``grad``), ``bias_correction=False`` drops both bias corrections, and
    ``bf16_out`` (same shape, bfloat16) receives the updated parameters. All tensors fp32 except ``bf16_out``.
    """
    g = grad * grad_scale if grad_scale != 1.0 else grad
    if weight_decay != 0:
        if adamw_mode:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2_sqrt = math.sqrt(1 - beta2**step) if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if bf16_out is not None:
        bf16_out.copy_(param)
