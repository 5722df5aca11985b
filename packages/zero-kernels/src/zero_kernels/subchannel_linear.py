"""Subchannel quantized training of a Linear layer: its three GEMMs run on 8-bit operands quantized on the fly.

Mirrors DeepSpeed 0.20's subchannel FP8/INT8 quantized training for ``nn.Linear`` (its tutorial: each GEMM
configured on its own; just before it runs both operands are quantized along its reduction dimension with fp32
scales; the result comes back in the layer's usual dtype; parameters, gradients, optimizer state and activations
keep their precision, so memory use does not drop):

========  ==============  ===================  ============================================
GEMM      computes        reduction dimension  operands quantized (``zero_kernels.subchannel_quant``)
========  ==============  ===================  ============================================
forward   ``y = x W^T``   input features       ``x`` along its rows, ``W`` along its rows
dx        ``dx = dy W``   output features      ``dy`` along its rows, ``W`` along its columns
dw        ``dW = dy^T x`` tokens               ``dy`` and ``x`` along their token dimension
========  ==============  ===================  ============================================

The bias is added to the GEMM's fp32 result and its gradient is the fp32 sum of ``dy`` over tokens; neither is
quantized. The forward saves ``x`` and the weight parameter itself (as ``F.linear`` does), so under ZeRO stage 3
the backward reads the weight that the stage re-gathered for it, and the quantized copies live only inside one GEMM.

How a GEMM runs (``backend``):

* ``"emulate"``: dequantize both operands to fp32 and multiply in fp32 (exact emulation of the rule on any device).
* ``"scaled_mm"``: ``torch._scaled_mm`` on the FP8 values with the fp32 scales, for FP8 GEMMs whose reduction
  dimension is one block (row scaling); on CUDA its output is bf16 (what torch's row-wise scaled matmul allows)
  and it needs every dimension divisible by 16. Any other GEMM (INT8, blockwise scaling, other shapes) is emulated.
* ``"auto"``: ``"scaled_mm"`` on a CUDA device with FP8 tensor cores (compute capability 8.9 or newer), else
  ``"emulate"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from zero_kernels.subchannel_quant import block_length, check_format, fake_quantize, quantize_subchannel

Backend = Literal["auto", "emulate", "scaled_mm"]
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")  # fmt: skip


@dataclass(frozen=True)
class GemmQuant:
    """How one GEMM's two operands are quantized: ``fmt`` "fp8" (e4m3) or "int8", ``block_size`` elements per
    scale along the reduction dimension (0: row scaling). Raises ValueError for anything else."""

    fmt: str = "fp8"
    block_size: int = 128

    def __post_init__(self) -> None:
        check_format(self.fmt, self.block_size)


@dataclass(frozen=True)
class LinearQuantRecipe:
    """The three GEMMs of a Linear layer; None leaves that GEMM in the layer's own precision."""

    forward: GemmQuant | None = GemmQuant()
    dx: GemmQuant | None = GemmQuant()
    dw: GemmQuant | None = GemmQuant()
    backend: Backend = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "emulate", "scaled_mm"):
            raise ValueError(f"backend must be 'auto', 'emulate' or 'scaled_mm', got {self.backend!r}")


def fp8_device(device: torch.device) -> bool:
    """True where ``torch._scaled_mm`` runs FP8 on tensor cores: CUDA with compute capability 8.9 or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _use_scaled_mm(a: torch.Tensor, b: torch.Tensor, spec: GemmQuant, backend: Backend) -> bool:
    if spec.fmt != "fp8" or block_length(a.shape[1], spec.block_size) != a.shape[1] or backend == "emulate":
        return False
    if a.device.type == "cuda":  # cuBLASLt's FP8 GEMM: every dimension a multiple of 16
        return fp8_device(a.device) and all(n % 16 == 0 and n > 0 for n in (*a.shape, b.shape[1]))
    return backend == "scaled_mm" and min(*a.shape, b.shape[1]) > 0


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, spec: GemmQuant) -> torch.Tensor:
    qa, sa = quantize_subchannel(a, 1, spec.fmt, spec.block_size)  # (M, R) with scales (M, 1)
    qb, sb = quantize_subchannel(b, 0, spec.fmt, spec.block_size)  # (R, N) with scales (1, N)
    qb = qb.t().contiguous().t()  # the second operand column-major, as cuBLASLt wants it
    out = torch.bfloat16 if a.is_cuda else torch.float32
    return torch._scaled_mm(qa.contiguous(), qb, scale_a=sa.contiguous(), scale_b=sb.contiguous(),
                            out_dtype=out).float()  # fmt: skip


def quantized_matmul(a: torch.Tensor, b: torch.Tensor, spec: GemmQuant | None, backend: Backend = "auto"):
    """``a @ b`` (``a``: (M, R), ``b``: (R, N)) with both operands quantized along R by ``spec``; fp32 (M, N).

    ``spec`` None: the plain product in ``a``'s dtype (then fp32). See the module docstring for ``backend``.
    """
    if spec is None:
        return torch.matmul(a, b.to(a.dtype)).float()
    if _use_scaled_mm(a, b, spec, backend):
        return _scaled_mm(a, b, spec)
    return torch.matmul(fake_quantize(a, 1, spec.fmt, spec.block_size), fake_quantize(b, 0, spec.fmt, spec.block_size))


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear`` would return: autocast's dtype inside an enabled autocast region, else ``x``'s."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _SubchannelLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: LinearQuantRecipe):
        out_dtype = _out_dtype(x)
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.bias_dtype = recipe, None if bias is None else bias.dtype
        with torch.autocast(x.device.type, enabled=False):  # the GEMM's own precision, never autocast's
            y = quantized_matmul(x.reshape(-1, x.shape[-1]), weight.t(), recipe.forward, recipe.backend)
            if bias is not None:
                y = y + bias.float()
        return y.to(out_dtype).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = quantized_matmul(dy2, weight, recipe.dx, recipe.backend).to(x.dtype).view(x.shape)
            if ctx.needs_input_grad[1]:
                x2 = x.reshape(-1, x.shape[-1])
                dw = quantized_matmul(dy2.t(), x2, recipe.dw, recipe.backend).to(weight.dtype)
            if ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None


def subchannel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      recipe: LinearQuantRecipe) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, weight, bias)`` with its forward and both gradient GEMMs quantized by ``recipe``.

    Shapes as ``F.linear``: ``x`` (..., in), ``weight`` (out, in), ``bias`` (out) or None -> (..., out) in ``x``'s
    dtype (autocast's inside an autocast region); gradients in the dtype of what they are the gradient of.
    """
    return _SubchannelLinearFunction.apply(x, weight, bias, recipe)


class SubchannelLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose GEMMs are quantized by ``recipe``, built around an existing layer: it holds that
    layer's own ``weight`` and ``bias`` parameters (the same objects, so an optimizer, a ZeRO partition or a tie
    made before still applies; ``state_dict`` keys are unchanged), its training mode and its module hooks."""

    def __init__(self, linear: torch.nn.Linear, recipe: LinearQuantRecipe):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.recipe = recipe  # frozen: shared by every layer the section selects
        self.train(linear.training)
        for name in _HOOK_DICTS:  # hooks set on the layer before it was swapped keep running
            getattr(self, name).update(getattr(linear, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return subchannel_linear(x, self.weight, self.bias, self.recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"
