"""ZeRO-1/2 pass: reduce-scatter gradient buckets inside the backward graph.

Parameters stay dense between steps (the core's buckets, refreshed by its post-step all-gather), so the forward
graph is untouched. In the backward graph each bucket's gradients go to ``reduce_grads(store, bucket, slots,
grads)`` right after the last of them is computed, and the graph returns None for them. A bucket of the core's
stage 1/2 layout holds a whole flat group (the 20m Llama: one bucket), so the reduce is cut into pieces of at most
``PIECE_BYTES`` (DDP's 25 MiB bucket, as the core's eager reducer): the pieces of the last layers reduce-scatter
while the backward computes the first ones, instead of one reduce after the last gradient. Mirrors DeepCompile's
``zero1_compile`` pass (arXiv 2504.09983, section 3.2; DeepSpeed ``deepspeed/compile/passes/zero1_compile.py``).
"""

from __future__ import annotations

import torch.fx as fx

from zero_compile.passes.base import Pass, PassContext
from zero_compile.passes.zero3 import insert_reduces
from zero_core.reducer import DDP_BUCKET_BYTES

PIECE_BYTES = DDP_BUCKET_BYTES


def zero1(gm: fx.GraphModule, ctx: PassContext, piece_bytes: int | None = PIECE_BYTES) -> fx.GraphModule:
    """The ZeRO-1 pass (see the module docstring); ``piece_bytes`` None: one reduce per bucket."""
    ctx.notes["zero1"] = {"reduces": insert_reduces(gm, ctx, piece_bytes)}
    return gm


def make_zero1(piece_bytes: int | None = PIECE_BYTES) -> Pass:
    """The ZeRO-1 pass as a :class:`Pass` with reduce pieces of at most ``piece_bytes`` (None: whole buckets).

    Raises ValueError for a piece size that is not a positive byte count."""
    if piece_bytes is not None and piece_bytes <= 0:
        raise ValueError(f"zero1: piece_bytes must be a positive byte count or None, got {piece_bytes}")
    return Pass("zero1", lambda gm, ctx: zero1(gm, ctx, piece_bytes), provides=frozenset({"zero1", "reduce"}),
                conflicts=frozenset({"gather"}), graphs=frozenset({"backward"}))  # fmt: skip


ZERO1 = make_zero1()
