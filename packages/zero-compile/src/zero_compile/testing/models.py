"""Small models for the compiled-path tests: a two-block transformer with sizes no world size divides."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """Pre-norm attention (causal SDPA) and a GELU MLP with an odd hidden width."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d + 1)
        self.down = nn.Linear(2 * d + 1, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    """vocab 37, d 14, 2 heads, 2 blocks: 5.5k parameters, odd sizes so every unit is padded at 2 and 3 ranks."""

    def __init__(self, vocab: int = 37, d: int = 14, layers: int = 2, heads: int = 2, graph_break: bool = False):
        super().__init__()
        self.graph_break = graph_break
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, targets):
        x = self.embed(ids)
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if self.graph_break and i == 0:
                if x.sum() > 1e9:  # data-dependent branch: Dynamo breaks the graph here
                    x = x * 0.5
                print(end="")  # a print: another graph break
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(steps: int, micro: int, world: int, batch: int = 2, seq: int = 6, vocab: int = 37, seed: int = 1):
    """``[step][micro][rank] -> (ids, targets)``, identical on every rank (each takes its own slice)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append([[(torch.randint(0, vocab, (batch, seq), generator=g),
                      torch.randint(0, vocab, (batch, seq), generator=g)) for _ in range(world)]
                    for _ in range(micro)])  # fmt: skip
    return out
