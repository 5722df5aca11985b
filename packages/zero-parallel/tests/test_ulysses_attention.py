"""Ulysses attention on 2 and 4 gloo ranks equals single-process full-sequence sdpa attention (fp32, 1e-6 absolute
and relative), forward and the gradients of query, key and value, with grouped-query attention, with fewer KV heads
than ranks, and at two sequence lengths (6 and 30) through one adapter (variable length)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from zero_comm.testing import run_ranks
from zero_parallel import SequenceParallelMPU, UlyssesSPAttentionHF, heads_to_sequence, sequence_to_heads

B, D = 2, 8


def sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention function in brief (the Llama tests run the real one; importing transformers in
    every rank here would cost more than the bodies): KV heads repeated by the module's ``num_key_value_groups``,
    causal without a mask, output [b, s, h, d]."""
    assert attention_mask is None
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2), None


class _Attention(torch.nn.Module):
    """What transformers' attention functions read from the attention module."""

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.is_causal = True


def _full(heads: int, kv_heads: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, seq, D, generator=g) for n in (heads, kv_heads, kv_heads))
    w = torch.randn(B, seq, heads, D, generator=g)  # weights of the scalar loss sum(out * w)
    return q, k, v, w


def _reference(heads: int, kv_heads: int, seq: int, seed: int):
    q, k, v, w = (t.requires_grad_(i < 3) for i, t in enumerate(_full(heads, kv_heads, seq, seed)))
    rep = heads // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out = out.transpose(1, 2)  # [b, s, h, d] as transformers' attention functions return
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _sharded(heads: int, kv_heads: int, seqs: tuple, sp: int):
    mpu = SequenceParallelMPU.build(sp)
    rank, group = mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_group()
    module = _Attention(heads, kv_heads)
    adapter = UlyssesSPAttentionHF(sdpa_attention_forward, B, heads, D, kv_heads, 1, group, seq_length_is_variable=True)
    checks = 0
    for seed, seq in enumerate(seqs):
        ref_out, ref_dq, ref_dk, ref_dv = _reference(heads, kv_heads, seq, seed)
        shard = slice(rank * seq // sp, (rank + 1) * seq // sp)
        q, k, v, w = _full(heads, kv_heads, seq, seed)
        q, k, v = (t[:, :, shard].clone().requires_grad_() for t in (q, k, v))
        out, _ = adapter(module, q, k, v, None, position_ids=torch.arange(seq)[shard].expand(B, -1))
        assert out.shape == (B, seq // sp, heads, D)
        (out * w[:, shard]).sum().backward()
        assert module.num_key_value_groups == heads // kv_heads  # restored after the call
        pairs = [(out, ref_out[:, shard]), (q.grad, ref_dq[:, :, shard]), (k.grad, ref_dk[:, :, shard]),
                 (v.grad, ref_dv[:, :, shard])]  # fmt: skip
        for got, want in pairs:
            # rtol: a repeated KV head's gradient sums its query heads' parts in another order than the reference
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            checks += 1
    return checks


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)], ids=["mha", "gqa", "sp-exceeds-kv-heads"])
def test_two_ranks_equal_full_sequence_sdpa(heads, kv_heads):
    assert run_ranks(_sharded, 2, heads, kv_heads, (6, 30), 2, timeout=60) == [8, 8]


def test_four_ranks_with_two_kv_heads_equal_full_sequence_sdpa():
    assert run_ranks(_sharded, 4, 4, 2, (12,), 4, timeout=60) == [4] * 4


def _round_trip(seq: int):
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(B * seq * 4 * D, dtype=torch.float32).reshape(B, seq, 4, D)
    local = full[:, rank * seq // world : (rank + 1) * seq // world]
    heads = sequence_to_heads(local, group)
    assert torch.equal(heads, full[:, :, rank * 4 // world : (rank + 1) * 4 // world])
    return torch.equal(heads_to_sequence(heads, group), local)


def test_layout_changes_move_the_expected_blocks():
    assert run_ranks(_round_trip, 2, 10, timeout=60) == [True, True]


def _errors():
    group = dist.group.WORLD
    msgs = []
    for make in (
        lambda: UlyssesSPAttentionHF(sdpa_attention_forward, B, 3, D, 3, 1, group, True),
        lambda: UlyssesSPAttentionHF(sdpa_attention_forward, B, 4, D, 3, 1, group, True),
        lambda: UlyssesSPAttentionHF(sdpa_attention_forward, B, 4, D, 2, 1, group, False, 3, 5),
        lambda: sequence_to_heads(torch.zeros(B, 3, 3, D), group),
    ):
        try:
            make()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    adapter = UlyssesSPAttentionHF(sdpa_attention_forward, B, 4, D, 2, 1, group, False, 3, 6)
    q, kv = torch.zeros(B, 4, 5, D), torch.zeros(B, 2, 5, D)
    for args in ((q, kv, kv), (q, kv[:, :1], kv), (q[:1], kv, kv)):
        try:
            adapter(_Attention(4, 2), *args, None)
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_shapes_are_named():
    msgs = run_ranks(_errors, 2, timeout=60)[0]
    assert msgs[0].startswith("attn_head_count=3 is not divisible by the sequence-parallel size 2")
    assert msgs[1].startswith("kv_head_count=3 and the sequence-parallel size 2 must divide one another")
    assert msgs[2].startswith("global_seq_length=5 must be local_seq_length=3 x the sequence-parallel size 2")
    assert msgs[3].startswith("x has 3 heads, not divisible by the sequence-parallel size 2")
    assert "this rank's sequence shard has 5 positions, but seq_length=6 was registered as fixed" in msgs[4]
    assert msgs[5].startswith("key must be [batch, kv heads, seq shard, head_dim] = (2, 2, 5, 8), got (2, 1, 5, 8)")
    assert msgs[6].startswith("query must be [batch, heads, seq shard, head_dim] = (2, 4, 5, 8), got (1, 4, 5, 8)")


def _flex_core(module, query, key, value, attention_mask, **kwargs):
    """transformers' flex_attention function minus its torch.compile (a compile costs tens of seconds on 2 cores):
    torch's flex attention with the ``BlockMask`` the adapter passes, output [b, s, h, d]."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    assert isinstance(attention_mask, BlockMask) and attention_mask.shape[-2:] == (query.shape[2], key.shape[2])
    return flex_attention(query, key, value, block_mask=attention_mask, enable_gqa=True).transpose(1, 2), None


def _flex_forward(heads: int, kv_heads: int, seq: int) -> float:
    group = dist.group.WORLD
    rank, sp = dist.get_rank(), dist.get_world_size()
    adapter = UlyssesSPAttentionHF(_flex_core, B, heads, D, kv_heads, 1, group, seq_length_is_variable=True)
    adapter.core_attn_implementation = "flex_attention"  # what register_with_transformers sets
    ref_out = _reference(heads, kv_heads, seq, 0)[0]
    shard = slice(rank * seq // sp, (rank + 1) * seq // sp)
    q, k, v = (t[:, :, shard] for t in _full(heads, kv_heads, seq, 0)[:3])
    with torch.no_grad():  # flex attention has no CPU backward
        out, _ = adapter(_Attention(heads, kv_heads), q, k, v, None)
    return (out - ref_out[:, shard]).abs().max().item()


def test_flex_attention_core_gets_a_causal_mask_of_the_whole_sequence():
    # the shard's mask (here none) is replaced by a causal BlockMask over all 30 positions; forward only
    assert max(run_ranks(_flex_forward, 2, 4, 2, 30, timeout=120)) <= 1e-6
