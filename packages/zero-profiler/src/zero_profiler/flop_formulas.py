"""FLOP and MAC formulas per ATen operator, as seen by a ``TorchDispatchMode``.

Conventions (the README repeats them as a table):

* matmul family (``mm``, ``bmm``, ``dot``, ``vdot``, ``mv``, ``addmm``, ``baddbmm``, ``addmv``, ``addbmm``): MACs are
  exact, ``#output elements x contracted dim`` (times batch); FLOPs = 2 per MAC. The additive input of the
  ``add*`` forms (the bias of ``nn.Linear``, which reaches ATen as ``addmm``) costs one FLOP per output element.
  ``torch.matmul`` and ``F.linear`` are composite: they arrive here as ``dot``/``mv``/``mm``/``bmm``/``addmm``
  (plus a pointwise ``add`` when ``linear`` cannot fold the bias), so the bias rule is the same on every path.
* convolution (1-d/2-d/3-d, transposed, grouped): MACs = batch x spatial positions x weight elements, where the
  positions are the output's (normal) or the input's (transposed); padded zeros count as MACs. FLOPs = 2 per MAC,
  plus one FLOP per output element for a bias. Backward: one forward's MACs for the input gradient, one for the
  weight gradient, and the bias gradient's reduction at one FLOP per output element.
* scaled dot-product attention (fused kernels): forward = the two matmuls ``Q K^T`` and ``P V``; backward = four
  matmuls (``dV``, ``dP``, ``dQ``, ``dK``), i.e. twice the forward, without the flash kernels' recompute. Scale,
  mask and softmax inside the fused kernel are not counted. The math fallback decomposes into ``bmm`` and
  pointwise ops and is counted by their rules.
* normalization: layer/group/batch norm (training) 5 FLOPs per element (mean, centre, square, accumulate,
  normalize), batch norm in eval 2, RMS norm 3; +1 per element for a weight and +1 for a bias. Softmax and
  log-softmax 4 per element. Their backward kernels are not counted.
* pointwise ops (``torch.Tag.pointwise``) with a floating-point result: 1 FLOP per output element; data movement
  (``clone``, ``where``, ``masked_fill``...) and integer/boolean results cost nothing.
* reductions ``sum``/``mean``: 1 FLOP per input element.

Every other op (views, copies, collectives, indexing, embedding lookups) costs 0. The MAC and 2-FLOPs-per-MAC
convention follows DeepSpeed's flops profiler and fvcore; the formulas here are our own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

aten = torch.ops.aten


class Category(str, Enum):
    """What kind of work an op does; the report breaks FLOPs down by it."""

    MATMUL = "matmul"
    CONV = "conv"
    ATTENTION = "attention"
    NORM = "norm"
    POINTWISE = "pointwise"
    REDUCTION = "reduction"


@dataclass(frozen=True)
class OpCount:
    """Work of one op call: ``macs`` multiply-accumulates and ``flops`` floating-point operations (both counts)."""

    macs: int
    flops: int
    category: Category


Formula = Callable[[tuple, dict, object], OpCount]


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _mm_like(macs: int, out_numel: int, has_bias: bool) -> OpCount:
    return OpCount(macs, 2 * macs + (out_numel if has_bias else 0), Category.MATMUL)


def _mm(args, kwargs, out) -> OpCount:
    (m, k), n = args[0].shape, args[1].shape[-1]
    return _mm_like(m * n * k, 0, False)


def _addmm(args, kwargs, out) -> OpCount:
    (m, k), n = args[1].shape, args[2].shape[-1]
    return _mm_like(m * n * k, m * n, kwargs.get("beta", 1) != 0)


def _bmm(args, kwargs, out) -> OpCount:
    (b, m, k), n = args[0].shape, args[1].shape[-1]
    return _mm_like(b * m * n * k, 0, False)


def _baddbmm(args, kwargs, out) -> OpCount:
    (b, m, k), n = args[1].shape, args[2].shape[-1]
    return _mm_like(b * m * n * k, b * m * n, kwargs.get("beta", 1) != 0)


def _addbmm(args, kwargs, out) -> OpCount:
    (b, m, k), n = args[1].shape, args[2].shape[-1]
    return _mm_like(b * m * n * k, m * n, kwargs.get("beta", 1) != 0)


def _dot(args, kwargs, out) -> OpCount:
    return _mm_like(int(args[0].shape[0]), 0, False)


def _mv(args, kwargs, out) -> OpCount:
    m, n = args[0].shape
    return _mm_like(m * n, 0, False)


def _addmv(args, kwargs, out) -> OpCount:
    m, n = args[1].shape
    return _mm_like(m * n, m, kwargs.get("beta", 1) != 0)


def _conv_macs(x_shape, w_shape, out_shape, transposed: bool) -> int:
    # Each position of the output (normal) or input (transposed) touches every weight element of its group once.
    positions = _numel(x_shape[2:]) if transposed else _numel(out_shape[2:])
    return int(x_shape[0]) * positions * _numel(w_shape)


def _convolution(args, kwargs, out) -> OpCount:
    x, w, bias, transposed = args[0], args[1], args[2], bool(args[6])
    macs = _conv_macs(x.shape, w.shape, out.shape, transposed)
    return OpCount(macs, 2 * macs + (out.numel() if bias is not None else 0), Category.CONV)


def _convolution_backward(args, kwargs, out) -> OpCount:
    grad_out, x, w, transposed, mask = args[0], args[1], args[2], bool(args[7]), args[10]
    fwd = _conv_macs(x.shape, w.shape, grad_out.shape, transposed)
    macs = fwd * (int(bool(mask[0])) + int(bool(mask[1])))
    return OpCount(macs, 2 * macs + (grad_out.numel() if mask[2] else 0), Category.CONV)


def _sdpa_macs(q, k, v) -> int:
    # q: (..., L_q, E), k: (..., L_k, E), v: (..., L_k, E_v); leading dims are batch x heads (of q, for GQA).
    batch_heads, l_q, e = _numel(q.shape[:-2]), int(q.shape[-2]), int(q.shape[-1])
    l_k, e_v = int(k.shape[-2]), int(v.shape[-1])
    return batch_heads * l_q * l_k * (e + e_v)


def _sdpa_forward(args, kwargs, out) -> OpCount:
    macs = _sdpa_macs(args[0], args[1], args[2])
    return OpCount(macs, 2 * macs, Category.ATTENTION)


def _sdpa_backward(args, kwargs, out) -> OpCount:
    macs = 2 * _sdpa_macs(args[1], args[2], args[3])  # args[0] is grad_out
    return OpCount(macs, 2 * macs, Category.ATTENTION)


def _affine_extra(weight, bias) -> int:
    return int(weight is not None) + int(bias is not None)


def _layer_norm(args, kwargs, out) -> OpCount:
    x = args[0]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    return OpCount(0, x.numel() * (5 + _affine_extra(weight, bias)), Category.NORM)


def _group_norm(args, kwargs, out) -> OpCount:
    return OpCount(0, args[0].numel() * (5 + _affine_extra(args[1], args[2])), Category.NORM)


def _batch_norm(args, kwargs, out) -> OpCount:
    training = bool(args[5]) if len(args) > 5 else bool(kwargs.get("training", True))
    return OpCount(0, args[0].numel() * ((5 if training else 2) + _affine_extra(args[1], args[2])), Category.NORM)


def _batch_norm_eval(args, kwargs, out) -> OpCount:
    return OpCount(0, args[0].numel() * (2 + _affine_extra(args[1], args[2])), Category.NORM)


def _rms_norm(args, kwargs, out) -> OpCount:
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    return OpCount(0, args[0].numel() * (3 + _affine_extra(weight, None)), Category.NORM)


def _softmax(args, kwargs, out) -> OpCount:
    return OpCount(0, 4 * args[0].numel(), Category.NORM)


def _reduction(args, kwargs, out) -> OpCount:
    x = args[0]
    return OpCount(0, x.numel() if x.is_floating_point() else 0, Category.REDUCTION)


_FORMULAS: dict[str, Formula] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "addbmm": _addbmm,
    "dot": _dot,
    "vdot": _dot,
    "mv": _mv,
    "addmv": _addmv,
    "convolution": _convolution,
    "convolution_backward": _convolution_backward,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa_forward,
    "_scaled_dot_product_flash_attention": _sdpa_forward,
    "_scaled_dot_product_efficient_attention": _sdpa_forward,
    "_scaled_dot_product_cudnn_attention": _sdpa_forward,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_backward,
    "_scaled_dot_product_flash_attention_backward": _sdpa_backward,
    "_scaled_dot_product_efficient_attention_backward": _sdpa_backward,
    "_scaled_dot_product_cudnn_attention_backward": _sdpa_backward,
    "native_layer_norm": _layer_norm,
    "native_group_norm": _group_norm,
    "native_batch_norm": _batch_norm,
    "_native_batch_norm_legit": _batch_norm,
    "_native_batch_norm_legit_no_training": _batch_norm_eval,
    "_fused_rms_norm": _rms_norm,
    "_softmax": _softmax,
    "_log_softmax": _softmax,
    "_safe_softmax": _softmax,
    "sum": _reduction,
    "mean": _reduction,
}

# Resolved to overload packets once; names absent from this torch build are simply not counted.
FORMULAS: dict[object, Formula] = {getattr(aten, name): fn for name, fn in _FORMULAS.items() if hasattr(aten, name)}

# Tagged pointwise, but they move or select data rather than compute.
_NOT_ARITHMETIC = {aten.clone, aten.where, aten.masked_fill, aten.positive, aten.conj_physical}
_ZERO = OpCount(0, 0, Category.POINTWISE)


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def count_op(func, args: tuple, kwargs: dict, out) -> OpCount:
    """Work done by one ATen op call ``func(*args, **kwargs) -> out`` under the module's conventions.

    ``func`` is an ``OpOverload`` as passed to ``__torch_dispatch__``. Returns ``OpCount(0, 0, ...)`` for ops
    that do no arithmetic. Shapes are read from the actual tensors, so counts are exact for the shapes executed.
    """
    packet = func.overloadpacket
    formula = FORMULAS.get(packet)
    if formula is not None:
        return formula(args, kwargs, out)
    if torch.Tag.pointwise in func.tags and packet not in _NOT_ARITHMETIC:
        result = _first_tensor(out)
        if result is not None and result.is_floating_point():
            return OpCount(0, result.numel(), Category.POINTWISE)
    return _ZERO
