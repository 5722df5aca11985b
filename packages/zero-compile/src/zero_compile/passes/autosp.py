"""autosp: Ulysses sequence parallelism inserted in the graph around every ``scaled_dot_product_attention``.

Runs on Dynamo's graph (torch-level operations, before AOTAutograd), where attention is one
``scaled_dot_product_attention`` call; the inserted operations carry their own autograd formulas
(``zero_compile.sp_ops``), so AOTAutograd derives the backward exchanges. Each rank feeds its shard of every sequence
(positions ``[r*s/sp, (r+1)*s/sp)`` on rank ``r`` of the sequence-parallel group, with their ``position_ids``), as
in eager Ulysses. For each attention node with query ``[b, h, s/sp, d]`` and key/value ``[b, kv, s/sp, d]``:

* query, key and value go through ``sequence_to_heads`` (-> ``[b, h/sp, s, d]``, ``[b, kv/sp, s, d]``); when
  ``sp`` is a multiple of ``kv`` (grouped-query attention with few KV heads), each KV head is first repeated
  ``sp/kv`` times so that every rank receives the one KV head its query heads use;
* the attention output goes through ``heads_to_sequence`` (-> ``[b, h, s/sp, d]``) before its users.

The attention itself is unchanged: ``is_causal`` then means causal over the whole sequence. Mirrors DeepSpeed
0.19.8's ``pass_insert_attention_all_to_all`` (``deepspeed/compile/passes/sp_compile.py``); DeepSpeed's autosp also
slices full-length inputs inside the graph (``prepare_autosp_inputs``), zero's takes the sharded inputs the eager
path takes (``zero_parallel``'s data adapter).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from zero_compile.passes.base import Pass, PassContext, PassError
from zero_compile.sp_ops import HEADS_TO_SEQUENCE, SEQUENCE_TO_HEADS

ATTENTION_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
"""The call targets the pass recognises as attention (Dynamo records ``F.scaled_dot_product_attention``)."""


def attention_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The ``scaled_dot_product_attention`` calls of ``graph``, in order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in ATTENTION_TARGETS]


def _shape(node, what: str, graph_id: int) -> tuple:
    val = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise PassError(f"autosp: the attention {what} of graph {graph_id} has no traced shape")
    if val.dim() != 4:
        raise PassError(f"autosp: the attention {what} of graph {graph_id} must be 4-D [batch, heads, seq, "
                        f"head_dim], got shape {tuple(val.shape)}")  # fmt: skip
    return tuple(val.shape)


def _arg(node: fx.Node, index: int, name: str, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def autosp(gm: fx.GraphModule, ctx: PassContext, group: int, world: int) -> fx.GraphModule:
    """The autosp pass (see the module docstring) over the sequence-parallel group ``group`` (an id of
    ``zero_compile.sp_ops.register_sp_group``) of ``world`` ranks.

    Raises:
        PassError: the graph has no attention node; an attention node has an ``attn_mask`` (a mask built on this
            rank's shard cannot describe the whole sequence; causal attention uses ``is_causal``, and padding is
            not supported: pack sequences); the query's heads are not divisible by ``world``; the key/value heads
            and ``world`` do not divide one another; key and value heads differ.
    """
    graph = gm.graph
    nodes = attention_nodes(graph)
    if not nodes:
        raise PassError(f"autosp: graph {ctx.graph_id} has no scaled_dot_product_attention; load the model with "
                        "attn_implementation='sdpa' (and without the eager Ulysses adapter registered)")  # fmt: skip
    repeats = 0
    for node in nodes:
        if _arg(node, 3, "attn_mask") is not None:
            raise PassError(f"autosp: {node.name} (graph {ctx.graph_id}) has an attn_mask; a mask built on this "
                            "rank's sequence shard cannot describe the whole sequence. Use causal attention "
                            "without a padding mask (pack sequences instead)")  # fmt: skip
        q, k, v = node.args[:3]
        h, kv, kv_v = (_shape(t, w, ctx.graph_id)[1] for t, w in ((q, "query"), (k, "key"), (v, "value")))
        if h % world:
            raise PassError(f"autosp: {node.name} has {h} query heads, not divisible by the sequence-parallel size "
                            f"{world}")  # fmt: skip
        if kv != kv_v:
            raise PassError(f"autosp: {node.name} has {kv} key heads and {kv_v} value heads; they must match")
        if kv % world and world % kv:
            raise PassError(f"autosp: {node.name} has {kv} key/value heads; they and the sequence-parallel size "
                            f"{world} must divide one another")  # fmt: skip
        rep = world // kv if world > kv else 1
        with graph.inserting_before(node):
            exchanged = []
            for t in (q, k, v):
                if rep > 1 and t is not q:
                    t = graph.call_function(torch.repeat_interleave, (t, rep), {"dim": 1})
                    repeats += 1
                exchanged.append(graph.call_function(SEQUENCE_TO_HEADS, (t, group, world)))
        node.args = (*exchanged, *node.args[3:])
        with graph.inserting_after(node):
            back = graph.call_function(HEADS_TO_SEQUENCE, (node, group, world))
        for user in [u for u in node.users if u is not back]:
            user.replace_input_with(node, back)
    ctx.notes["autosp"] = {"attention": len(nodes), "kv_repeats": repeats}
    return gm


def make_autosp(group: int, world: int) -> Pass:
    """The autosp pass as a :class:`Pass` for Dynamo graphs (``PassContext.kind`` "dynamo").

    Raises ValueError for a ``world`` below 1."""
    if world < 1:
        raise ValueError(f"autosp: the sequence-parallel size must be at least 1, got {world}")
    return Pass("autosp", lambda gm, ctx: autosp(gm, ctx, group, world), provides=frozenset({"autosp"}),
                conflicts=frozenset({"gather", "reduce"}), graphs=frozenset({"dynamo"}))  # fmt: skip
