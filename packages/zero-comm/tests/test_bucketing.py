"""Bucket plans, flat buffers, and coalesced all-gather / reduce-scatter on 2, 3 and 4 ranks."""

import pytest
import torch
import torch.distributed as dist

from zero_comm import (
    FlatBuffer,
    all_gather_coalesced,
    group_by_dtype,
    plan_buckets,
    reduce_scatter_coalesced,
    reduce_scatter_tensor,
)
from zero_comm.testing import run_ranks


def test_plan_buckets_packs_in_order_and_pads():
    buckets = plan_buckets([5, 7, 3, 20, 0, 1], bucket_numel=12, pad_to=4)
    # 5+7 fit 12; 3 starts a new bucket; 20 is larger than a bucket: alone; 0 and 1 share the last
    assert [[s.index for s in b.slots] for b in buckets] == [[0, 1], [2], [3], [4, 5]]
    assert [(b.start, b.end) for b in buckets] == [(0, 12), (12, 16), (16, 36), (36, 40)]
    assert [(s.start, s.end) for s in buckets[0].slots] == [(0, 5), (5, 12)]
    assert (buckets[2].slots[0].start, buckets[2].slots[0].end) == (16, 36)
    assert all(b.numel % 4 == 0 for b in buckets)
    assert buckets[2].shard_range(1, 4) == (21, 26)
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        buckets[1].shard_range(0, 3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "abc", True])
def test_plan_buckets_rejects_bad_bucket_numel(bad):
    with pytest.raises(ValueError, match=f"bucket_numel must be an int >= 1, got {bad!r}"):
        plan_buckets([3], bucket_numel=bad)


def test_plan_buckets_rejects_bad_pad_and_numels():
    with pytest.raises(ValueError, match="pad_to"):
        plan_buckets([3], bucket_numel=4, pad_to=0)
    with pytest.raises(ValueError, match=r"numels\[1\] must be an int >= 0, got -2"):
        plan_buckets([3, -2], bucket_numel=4)


def test_flat_buffer_views_share_storage_and_keep_values():
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2, 3)]
    buf = FlatBuffer.from_tensors(tensors, bucket_numel=16, pad_to=3)
    for t, v in zip(tensors, buf.views(), strict=True):
        assert torch.equal(t, v) and v.shape == t.shape
    buf.view(1).mul_(2)  # a write through the view lands in the buffer
    slot = buf.buckets[1].slots[0]  # 15 + 7 > 16: tensor 1 opens bucket 1
    assert slot.index == 1
    assert torch.equal(buf.data[slot.start : slot.end], tensors[1] * 2)
    assert buf.data.numel() == buf.buckets[-1].end and buf.data.numel() % 3 == 0
    assert float(buf.data[buf.buckets[-1].slots[-1].end :].abs().sum()) == 0.0  # padding is zero
    with pytest.raises(ValueError, match=r"tensors\[1\] is torch.bfloat16"):
        FlatBuffer.from_tensors([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)], bucket_numel=4)
    assert group_by_dtype([torch.ones(1), torch.ones(1, dtype=torch.bfloat16), torch.ones(1)]) == {
        torch.float32: [0, 2],
        torch.bfloat16: [1],
    }


def _body(sizes):
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()

    def data(r, n, salt):
        return torch.randn(n, generator=torch.Generator().manual_seed(100 * salt + r))

    # coalesced all-gather: uneven shard sizes
    shards = [[data(r, k, i) for i, k in enumerate(sizes)] for r in range(world)]
    outs = [torch.empty(world * k) for k in sizes]
    all_gather_coalesced(outs, shards[rank], group, async_op=True).wait(10)
    for i, o in enumerate(outs):
        assert torch.equal(o, torch.cat([shards[r][i] for r in range(world)])), i

    # coalesced reduce-scatter, sum and avg
    fulls = [[data(r, world * k, 10 + i) for i, k in enumerate(sizes)] for r in range(world)]
    for op in ("sum", "avg"):
        outs = [torch.empty(k) for k in sizes]
        reduce_scatter_coalesced(outs, fulls[rank], group, op=op)
        for i, (o, k) in enumerate(zip(outs, sizes, strict=True)):
            ref = torch.stack([fulls[r][i] for r in range(world)]).double().sum(0)[rank * k : (rank + 1) * k]
            ref = ref / world if op == "avg" else ref
            torch.testing.assert_close(o.double(), ref, rtol=1e-6, atol=1e-6)

    # bucketed gradients in a FlatBuffer: each rank's shard of each bucket equals the reference sum
    grads = [[data(r, n, 50 + i) for i, n in enumerate(sizes)] for r in range(world)]
    buf = FlatBuffer([(n,) for n in sizes], torch.float32, bucket_numel=7, pad_to=world)
    for v, g in zip(buf.views(), grads[rank], strict=True):
        v.copy_(g)
    ref_buf = FlatBuffer([(n,) for n in sizes], torch.float32, bucket_numel=7, pad_to=world)
    for i, v in enumerate(ref_buf.views()):
        v.copy_(torch.stack([grads[r][i] for r in range(world)]).sum(0))
    for b in range(len(buf.buckets)):
        shard = torch.empty(buf.buckets[b].numel // world)
        reduce_scatter_tensor(shard, buf.bucket_view(b), group)
        torch.testing.assert_close(shard, ref_buf.shard_view(b, rank, world), rtol=1e-6, atol=1e-6)

    try:
        all_gather_coalesced([torch.empty(world * 2), torch.empty(5)], [torch.empty(2), torch.empty(3)], group)
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_coalesced_collectives_match_reference(world):
    msgs = run_ranks(_body, world, [3, 1, 6, 2, 5], timeout=60)
    assert all("outputs[1] has shape (5,)" in m and "inputs[1] shape (3,)" in m for m in msgs), msgs[0]
