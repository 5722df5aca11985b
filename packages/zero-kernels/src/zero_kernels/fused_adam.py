"""FusedAdam: multi-tensor Adam/AdamW on CUDA in one kernel launch per parameter group.

Uses the ``cuda_ops`` op when it builds (CUDA torch + nvcc); otherwise steps with ``torch.optim.AdamW``'s
``_fused_adamw``/``_fused_adam`` functional kernels where available, and the pure-torch reference elsewhere, so the
same optimizer runs (slower) everywhere. Mirrors DeepSpeed's ``FusedAdam`` / apex's ``multi_tensor_adam`` with
torch's state layout (``step``, ``exp_avg``, ``exp_avg_sq``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zero_kernels import loader
from zero_kernels.adam_reference import adam_step_reference


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 CUDA parameters (CPU parameters use the pure-torch path).

    Args:
        params, lr, betas, eps: as ``torch.optim.AdamW``.
        weight_decay: default None = 0.01 with ``adamw_mode`` (torch AdamW), 0.0 without (torch Adam).
        adamw_mode: decoupled (True) or L2 (False) weight decay. bias_correction: False drops both corrections.

    Raises:
        ValueError: bad hyper-parameters; at ``step``, a non-fp32 parameter or gradient (named by group/index).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        adamw_mode: bool = True,
        bias_correction: bool = True,
    ):
        if weight_decay is None:
            weight_decay = 0.01 if adamw_mode else 0.0
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"FusedAdam: lr, eps, weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: betas must be two floats in [0, 1), got {betas}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )  # fmt: skip
        super().__init__(params, defaults)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0):
        """One step over every parameter with a gradient; ``grad_scale`` multiplies gradients inside the kernel."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            # Tensors that share a step count go into one launch (all of them, after the first step).
            by_step: dict[int, list[list[torch.Tensor]]] = {}
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32 or p.grad.is_sparse:
                    raise ValueError(
                        f"FusedAdam: group {gi} param {pi} needs fp32 dense param and grad, got {p.dtype}/"
                        f"{p.grad.dtype}"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                lists = by_step.setdefault(int(state["step"].item()), [[], [], [], []])
                for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                    lst.append(t)
            kw = dict(
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adamw_mode=group["adamw_mode"], bias_correction=group["bias_correction"], grad_scale=grad_scale,
            )  # fmt: skip
            for step, (ps, gs, ms, vs) in by_step.items():
                self._apply(ps, gs, ms, vs, step, kw)
        return loss

    @staticmethod
    def _apply(ps, gs, ms, vs, step: int, kw: dict) -> None:
        fused = all(p.is_cuda and p.is_contiguous() and g.is_contiguous() for p, g in zip(ps, gs))
        op = loader.resolved("cuda_ops") if fused else None
        if op is not None:
            op.fused_adam(
                ps, gs, ms, vs, kw["lr"], kw["beta1"], kw["beta2"], kw["eps"], kw["weight_decay"], step,
                kw["adamw_mode"], kw["bias_correction"], kw["grad_scale"],
            )  # fmt: skip
            return
        for p, g, m, v in zip(ps, gs, ms, vs):
            adam_step_reference(p, g, m, v, step=step, **kw)
