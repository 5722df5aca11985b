"""The autosp pass on Dynamo graphs, without ranks: where it puts the exchanges around each
``scaled_dot_product_attention`` (query, key and value through ``sequence_to_heads``, the output through
``heads_to_sequence``; key/value heads repeated when fewer than the sequence-parallel size), and the graphs it
refuses (a shard mask, heads that do not divide, no attention). Training equality on 2 ranks is in
tests-integration/test_compile_autosp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zero_compile.passes import PassContext, PassError, run_passes
from zero_compile.passes.autosp import attention_nodes, make_autosp
from zero_compile.sp_ops import HEADS_TO_SEQUENCE, SEQUENCE_TO_HEADS


class _Attention(torch.nn.Module):
    """``[b, s, 8]`` -> ``[b, s, 2 * heads]``: ``heads`` query heads and ``kv`` key/value heads of size 2."""

    def __init__(self, heads: int, kv: int, masked: bool = False):
        super().__init__()
        self.heads, self.kv, self.d, self.masked = heads, kv, 2, masked
        self.q = torch.nn.Linear(8, heads * self.d)
        self.kv_proj = torch.nn.Linear(8, 2 * kv * self.d)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2, self.kv, self.d).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.masked else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.masked, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, -1)


def _graph(module: torch.nn.Module) -> torch.fx.GraphModule:
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(torch.randn(2, 4, 8))
    return captured[0]


def _autosp(gm, world: int = 2) -> PassContext:
    ctx = PassContext(kind="dynamo", graph_id=0, store=-1, params={}, inputs=[])
    run_passes(gm, ctx, [make_autosp(7, world)])
    return ctx


@pytest.mark.parametrize("heads, kv, repeats", [(4, 2, 0), (4, 1, 2)])
def test_exchanges_surround_every_attention(heads, kv, repeats):
    gm = _graph(_Attention(heads, kv))
    ctx = _autosp(gm)
    assert ctx.notes["autosp"] == {"attention": 1, "kv_repeats": repeats}
    [attn] = attention_nodes(gm.graph)
    q, k, v = attn.args[:3]
    assert [t.target for t in (q, k, v)] == [SEQUENCE_TO_HEADS] * 3
    assert all(t.args[1:] == (7, 2) for t in (q, k, v))  # the group id and size the pass was given
    rep = [t.args[0] for t in (k, v) if t.args[0].target is torch.repeat_interleave]
    assert len(rep) == repeats and all(r.args[1] == 2 and r.kwargs == {"dim": 1} for r in rep)
    assert q.args[0].target is not torch.repeat_interleave  # query heads are never repeated
    [back] = attn.users  # only the exchange back reads the attention output; its old users read the exchange
    assert back.target is HEADS_TO_SEQUENCE and back.args == (attn, 7, 2) and len(back.users) == 1


def test_refused_graphs_say_why():
    with pytest.raises(PassError, match="has an attn_mask; a mask built on this rank's sequence shard"):
        _autosp(_graph(_Attention(4, 2, masked=True)))
    with pytest.raises(PassError, match="has 4 query heads, not divisible by the sequence-parallel size 3"):
        _autosp(_graph(_Attention(4, 4)), world=3)
    with pytest.raises(PassError, match="has 3 key/value heads; they and the sequence-parallel size 2 must divide"):
        _autosp(_graph(_Attention(6, 3)))
    with pytest.raises(PassError, match="graph 0 has no scaled_dot_product_attention"):
        _autosp(_graph(torch.nn.Linear(8, 8)))
    with pytest.raises(ValueError, match="at least 1"):
        make_autosp(0, 0)
