"""cpu_attention: a bf16 or fp16 ``scaled_dot_product_attention`` on CPU computed in fp32 where that is faster.

torch's CPU flash attention is slower in bf16 than in fp32 at short sequences, its backward above all, and faster
at long ones; in fp16 it is several times slower at every length (docs/benchmarks.md, "CPU attention in fp32").
The pass times both ways on each attention call's own shapes, once per process and set of shapes (forward and
backward on random inputs), and where the fp32 way takes at most :data:`MARGIN` of the time it rewrites the call:
query, key, value (and a floating ``attn_mask``) cast to fp32, the attention in fp32, its output cast back to the
input dtype. Shapes not known when compiling (dynamic shapes) keep their kernel.

Runs on Dynamo's graph (torch-level operations, before AOTAutograd), so AOTAutograd derives the backward: the
fp32 attention's backward and the casts. The output is the fp32 attention rounded once to the input dtype; it
differs from the reduced-precision kernel's by rounding, and two processes may choose differently (each times its
own shapes).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from zero_compile.passes.autosp import ATTENTION_TARGETS
from zero_compile.passes.base import PassContext

REDUCED = (torch.bfloat16, torch.float16)
"""The dtypes whose attention the pass may move to fp32."""

MARGIN = 0.9
"""The fp32 way is chosen when its median time is at most this fraction of the reduced-precision kernel's."""

LONG_S = 0.02
"""Seconds: a shape whose reduced-precision forward and backward takes longer is timed by one run of each way."""

_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class AttentionShape:
    """What an attention call's speed depends on: the shapes of query, key and value (``[batch, heads, seq,
    head_dim]``), their dtype, the mask's shape and dtype (None: no mask), and the call's other arguments."""

    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    dtype: torch.dtype
    mask: tuple[tuple[int, ...], torch.dtype] | None
    is_causal: bool
    scale: float | None
    enable_gqa: bool


_CHOICES: dict[AttentionShape, bool] = {}  # shape -> fp32 is faster; one timing per process


def _random(shape: AttentionShape) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    qkv = [torch.randn(s, dtype=shape.dtype).requires_grad_() for s in (shape.query, shape.key, shape.value)]
    mask = None
    if shape.mask is not None:
        mask_shape, mask_dtype = shape.mask
        mask = (
            torch.ones(mask_shape, dtype=torch.bool)
            if mask_dtype == torch.bool
            else torch.zeros(mask_shape, dtype=mask_dtype)
        )
    return qkv, mask


def _run(shape: AttentionShape, fp32: bool) -> float:
    """Seconds of one forward and backward of the attention call on random inputs, the fp32 way or not."""
    (q, k, v), mask = _random(shape)
    kwargs = {"is_causal": shape.is_causal, "scale": shape.scale}
    if shape.enable_gqa:
        kwargs["enable_gqa"] = True
    start = time.perf_counter()
    if fp32:
        m = mask.float() if mask is not None and mask.is_floating_point() else mask
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, **kwargs).to(shape.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def time_both(shape: AttentionShape, rounds: int = 5) -> tuple[float, float]:
    """Median seconds of a forward and backward of ``shape``'s attention: (reduced-precision kernel, fp32 way),
    over ``rounds`` interleaved runs after a warm-up of each; one run of each (the kernel's after its warm-up) when
    that run took more than :data:`LONG_S`."""
    _run(shape, False)  # the first call of a process pays one-time set-up
    first = _run(shape, False)
    if first > LONG_S:
        return first, _run(shape, True)
    _run(shape, True)
    native, fp32 = [], []
    for _ in range(rounds):
        native.append(_run(shape, False))
        fp32.append(_run(shape, True))
    native.sort()
    fp32.sort()
    return native[rounds // 2], fp32[rounds // 2]


def fp32_is_faster(shape: AttentionShape, timer: Callable[[AttentionShape], tuple[float, float]] = time_both) -> bool:
    """Whether ``shape``'s attention runs in fp32 (see the module notes); timed by ``timer`` once per process."""
    if shape not in _CHOICES:
        with torch.enable_grad():
            native, fp32 = timer(shape)
        _CHOICES[shape] = fp32 <= MARGIN * native
    return _CHOICES[shape]


def _value(arg):
    return arg.meta.get("example_value") if isinstance(arg, fx.Node) else None


def attention_shape(node: fx.Node) -> AttentionShape | None:
    """``node``'s :class:`AttentionShape` when it is a reduced-precision attention on CPU with shapes known when
    compiling, else None."""
    args = dict(zip(_ARGS, node.args, strict=False)) | dict(node.kwargs)
    q, k, v = (_value(args.get(name)) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return None
    if q.device.type != "cpu" or q.dtype not in REDUCED or args.get("dropout_p", 0.0):
        return None
    mask_arg = args.get("attn_mask")
    mask = _value(mask_arg)
    if mask_arg is not None and not isinstance(mask, torch.Tensor):
        return None
    shapes = [tuple(t.shape) for t in (q, k, v, *([mask] if mask is not None else []))]
    if not all(isinstance(d, int) for s in shapes for d in s):
        return None  # symbolic sizes: dynamic shapes are not timed
    scale = args.get("scale")
    if scale is not None and not isinstance(scale, float | int):
        return None
    return AttentionShape(shapes[0], shapes[1], shapes[2], q.dtype,
                          None if mask is None else (shapes[3], mask.dtype), bool(args.get("is_causal", False)),
                          None if scale is None else float(scale), bool(args.get("enable_gqa", False)))  # fmt: skip


def _cast(graph: fx.Graph, arg: fx.Node, dtype: torch.dtype) -> fx.Node:
    """``arg.to(dtype)`` as a new node, with its traced value where ``arg`` has one."""
    node = graph.call_method("to", (arg, dtype))
    value = _value(arg)
    if isinstance(value, FakeTensor):
        with value.fake_mode:
            node.meta["example_value"] = value.to(dtype)
    return node


def cpu_attention(gm: fx.GraphModule, ctx: PassContext,
                  choose: Callable[[AttentionShape], bool] = fp32_is_faster) -> fx.GraphModule:  # fmt: skip
    """The cpu_attention pass (see the module notes): each attention call whose :func:`attention_shape` is known
    and ``choose`` picks runs in fp32. Notes ``ctx.notes["cpu_attention"]``: ``{"fp32": n, "kept": m}``."""
    graph = gm.graph
    fp32 = kept = 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in ATTENTION_TARGETS]:
        shape = attention_shape(node)
        if shape is None or not choose(shape):
            kept += shape is not None
            continue
        args = dict(zip(_ARGS, node.args, strict=False)) | dict(node.kwargs)
        with graph.inserting_before(node):
            for name in ("query", "key", "value"):
                args[name] = _cast(graph, args[name], torch.float32)
            mask = args.get("attn_mask")
            if mask is not None and _value(mask).is_floating_point():
                args["attn_mask"] = _cast(graph, mask, torch.float32)
            out = graph.call_function(node.target, (args.pop("query"), args.pop("key"), args.pop("value")), args)
            back = graph.call_method("to", (out, shape.dtype))
        value = _value(node)
        if isinstance(value, FakeTensor):
            with value.fake_mode:
                out.meta["example_value"] = value.to(torch.float32)
            back.meta["example_value"] = value
        node.replace_all_uses_with(back)
        graph.erase_node(node)
        fp32 += 1
    ctx.notes["cpu_attention"] = {"fp32": fp32, "kept": kept}
    return gm
