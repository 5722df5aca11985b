"""CPU Adam/AdamW: one pass over fp32 params, grads and moments with run-time SIMD dispatch and OpenMP.

``adam_step`` is the functional core (one tensor, the offload step: gradient multiplier, AdamW, bf16 copy-out);
``CPUAdam`` is the ``torch.optim.Optimizer`` built on it. Mirrors DeepSpeed's ``DeepSpeedCPUAdam`` (ZeRO-Offload,
Ren et al. 2021, section 5.1) with torch's state layout (``step``, ``exp_avg``, ``exp_avg_sq``) so checkpoints
move between this optimizer and ``torch.optim.AdamW``/``Adam``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import torch

from zero_kernels import loader
from zero_kernels.adam_reference import adam_step_reference
from zero_kernels.memory import zeros_hugepage_like

_ISA_ENV = "ZERO_KERNELS_ISA"


_isas: list[str] = []  # what the op reports it can run here, filled when it is first resolved


def _op():
    op = loader.resolved("cpu_adam")
    if op is not None and not _isas:
        _isas.extend(op.supported_isas())
    return op


def cpu_isa() -> str | None:
    """Instruction set the op runs with: ``$ZERO_KERNELS_ISA`` if set (``avx512``, ``avx2``, ``generic``), else the
    best this CPU supports; None if the op is unavailable. Raises ValueError for an ISA the CPU lacks."""
    if _op() is None:
        return None
    supported = _isas
    wanted = os.environ.get(_ISA_ENV)
    if wanted:
        if wanted not in supported:
            raise ValueError(f"{_ISA_ENV}={wanted!r} but this CPU supports {supported}")
        return wanted
    return supported[0]


def _check(name: str, t: torch.Tensor, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.numel() != like.numel():
        raise ValueError(
            f"adam_step: {name} must be a contiguous CPU {dtype} tensor of {like.numel()} elements; got "
            f"{t.dtype} on {t.device}, {t.numel()} elements, contiguous={t.is_contiguous()}"
        )


@torch.no_grad()
def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    bf16_out: torch.Tensor | None = None,
    num_threads: int | None = None,
    use_op: bool | None = None,
) -> None:
    """One Adam/AdamW step over one tensor, in place, in a single pass over memory.

    Args:
        param, grad, exp_avg, exp_avg_sq: contiguous CPU fp32 tensors of equal numel (any shape). ``grad`` is read,
            never written.
        step: the step number after this update (1 on the first step), for bias correction.
        lr, beta1, beta2, eps, weight_decay: as in ``torch.optim.AdamW``.
        adamw_mode: True = decoupled weight decay (AdamW), False = L2 added to the gradient (Adam).
        bias_correction: False drops both bias corrections (DeepSpeed's ``bias_correction=False``).
        grad_scale: the gradient is multiplied by this on the fly (1/loss_scale x clip coefficient).
        bf16_out: optional contiguous bfloat16 tensor of the same numel; receives the updated params (RNE).
        num_threads: OpenMP threads; default ``torch.get_num_threads()``.
        use_op: True = require the C++ op, False = torch reference, None = op if available.

    Raises:
        ValueError: a tensor of the wrong dtype/device/size/layout, or step < 1.
        zero_kernels.BuildError: ``use_op=True`` and the op cannot be built.
    """
    if step < 1:
        raise ValueError(f"adam_step: step must be >= 1, got {step}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check(name, t, param)
    _check("param", param, param)
    if bf16_out is not None:
        _check("bf16_out", bf16_out, param, torch.bfloat16)
    op = None if use_op is False else _op()
    if op is None and use_op:
        loader.load("cpu_adam")  # raises the BuildError with the compiler's message
    if op is None:
        adam_step_reference(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction,
            grad_scale=grad_scale, bf16_out=None if bf16_out is None else bf16_out.view(param.shape),
        )  # fmt: skip
        return
    op.adam_step(
        cpu_isa(),
        num_threads or torch.get_num_threads(),
        param.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        0 if bf16_out is None else bf16_out.data_ptr(),
        param.numel(),
        int(step),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        bool(adamw_mode),
        bool(bias_correction),
        float(grad_scale),
    )


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for fp32 CPU parameters, stepping each parameter in one fused C++ pass.

    Args:
        params: iterable of parameters or of param-group dicts (as any torch optimizer).
        lr: learning rate. betas: (beta1, beta2). eps: added to the denominator.
        weight_decay: default None = 0.01 in AdamW mode and 0.0 in Adam mode (the defaults of ``torch.optim.AdamW``
            and ``torch.optim.Adam``, so the mode never silently changes the decay).
        adamw_mode: True = decoupled weight decay (``torch.optim.AdamW``), False = L2 (``torch.optim.Adam``).
            ``adam_w_mode`` (DeepSpeed's FusedAdam spelling) is accepted as the same flag.
        bias_correction: False drops both bias corrections.
        use_op: True = require the C++ op, False = pure-torch reference, None = op if it builds, else reference.

    State per parameter: ``step`` (0-dim fp32 tensor, as torch), ``exp_avg`` and ``exp_avg_sq`` (fp32, param's
    shape), so ``state_dict()`` loads into ``torch.optim.AdamW`` and back.

    Raises:
        ValueError: bad hyper-parameters, both mode spellings disagreeing, or (at ``step``) a non-fp32,
            non-CPU or sparse parameter/gradient, named by group and index.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        adamw_mode: bool | None = None,
        bias_correction: bool = True,
        *,
        adam_w_mode: bool | None = None,
        use_op: bool | None = None,
    ):
        if adamw_mode is not None and adam_w_mode is not None and adamw_mode != adam_w_mode:
            raise ValueError(f"CPUAdam: adamw_mode={adamw_mode} and adam_w_mode={adam_w_mode} disagree; pass one")
        mode = next((m for m in (adamw_mode, adam_w_mode) if m is not None), True)
        if weight_decay is None:
            weight_decay = 0.01 if mode else 0.0
        if not lr >= 0.0:
            raise ValueError(f"CPUAdam: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"CPUAdam: eps must be >= 0, got {eps}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"CPUAdam: betas must be two floats in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"CPUAdam: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adamw_mode=bool(mode),
            bias_correction=bias_correction,
        )  # fmt: skip
        super().__init__(params, defaults)
        if use_op:
            loader.load("cpu_adam")  # fail now, with the compiler's message, not at the first step
        self.use_op = use_op

    def __setstate__(self, state: dict) -> None:
        # load_state_dict() calls this: a state dict saved by torch.optim.AdamW/Adam lacks our two group keys.
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("adamw_mode", self.defaults["adamw_mode"])
            group.setdefault("bias_correction", self.defaults["bias_correction"])

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, bf16_out: Mapping[torch.Tensor, torch.Tensor] = None):
        """One optimizer step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (as in torch).
            grad_scale: multiplies every gradient inside the update (1/loss_scale x clip coefficient); the
                ``.grad`` tensors are not modified.
            bf16_out: optional map parameter -> bfloat16 tensor (same numel) that receives its updated value.

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bf16_out = bf16_out or {}
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"CPUAdam: group {gi} param {pi} has a sparse gradient; not supported")
                if p.dtype != torch.float32 or p.device.type != "cpu" or p.grad.dtype != torch.float32:
                    raise ValueError(
                        f"CPUAdam: group {gi} param {pi} must be an fp32 CPU tensor with an fp32 gradient; got "
                        f"param {p.dtype} on {p.device}, grad {p.grad.dtype}"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = zeros_hugepage_like(p)
                    state["exp_avg_sq"] = zeros_hugepage_like(p)
                state["step"] += 1
                out = bf16_out.get(p)
                if p.is_contiguous() and p.grad.is_contiguous():
                    param, grad = p, p.grad
                else:
                    param, grad = p.contiguous(), p.grad.contiguous()
                adam_step(
                    param, grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"].item()),
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                    adamw_mode=group["adamw_mode"], bias_correction=group["bias_correction"], grad_scale=grad_scale,
                    bf16_out=out, use_op=self.use_op,
                )  # fmt: skip
                if param is not p:
                    p.copy_(param)
        return loss
