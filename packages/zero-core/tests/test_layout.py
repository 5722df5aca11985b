"""Flat layout arithmetic (padding, shard ranges, resharding) and the O(buckets) collective count."""

import dataclasses
import json

import pytest
import torch
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.layout import Bucket, FlatGroup, LayoutError, build_flat_group, split_by_size


def _params(*sizes):
    return [(f"p{i}", nn.Parameter(torch.arange(n, dtype=torch.float32) + 100 * i)) for i, n in enumerate(sizes)]


def test_padding_shards_and_resharding_round_trip():
    params = _params(104, 13, 91, 7, 28, 4)  # TinyNet's sizes, 247 elements
    order = {id(p): i for i, (_, p) in enumerate(params)}
    buckets = split_by_size(params, 120)
    assert [sum(p.numel() for _, p in b) for b in buckets] == [104, 104, 39]  # filled from the end
    full = torch.cat([p.detach() for _, p in params])
    for parts in (1, 2, 3, 4):
        shards = []
        for rank in range(parts):
            fg = build_flat_group(0, 0, torch.float32, parts, rank, buckets, [True] * 3, 0, order)
            assert fg.numel == 247 and fg.padded_numel % parts == 0
            assert all(b.padded_numel % parts == 0 and b.padded_numel - b.numel < parts for b in fg.buckets)
            shard = fg.shard_from_full(full)
            assert shard.numel() == fg.shard_numel
            for lo, hi, at in fg.shard_ranges():  # every owned range holds exactly the flat data
                assert torch.equal(shard[at : at + hi - lo], full[lo:hi])
            shards.append(shard)
        assert torch.equal(fg.full_from_shards(shards), full)


def _count_body(configs):
    return [_count_one(stage, buckets) for stage, buckets in configs]


def _count_one(stage, buckets):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(6)])  # 12 params, 660 elements
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=buckets), PrecisionPolicy())
    n_buckets = sum(len(g.buckets) for g in rt.flat_groups)
    x = torch.randn(4, 10)
    with CommsLogger() as log:
        rt.backward(rt.module(x).square().mean(), is_boundary=True)
        after_backward = log.count()
        rt.step()
    return n_buckets, after_backward, log.count()


def test_collectives_per_step_scale_with_buckets_not_params():
    configs = [(stage, size) for stage in (0, 1, 2) for size in (10**6, 220)]
    results = run_ranks(_count_body, 2, configs, timeout=60)[0]
    for (stage, size), (n_buckets, backward, total) in zip(configs, results):
        assert n_buckets == (1 if size == 10**6 else 3)
        assert backward == n_buckets, (stage, size, backward)  # one reduction per bucket, 12 parameters
        # + one small all-reduce (the norm at stages 1/2, and at every stage which parameters got a gradient on
        # some rank) + stages 1/2: one all-gather per bucket
        assert total == (backward + 1 if stage == 0 else backward + 1 + n_buckets), (stage, total)


def test_layout_is_frozen_and_holds_no_runtime_state():
    params = _params(104, 13, 91, 7)
    order = {id(p): i for i, (_, p) in enumerate(params)}
    fg = build_flat_group(0, 0, torch.float32, 2, 1, split_by_size(params, 120), [False, True], 3, order)
    b = fg.buckets[0]
    for obj, name in ((b, "start"), (fg, "buckets"), (b.slots[0], "bucket_offset")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 0)
    # what lives where, in elements, per rank, and nothing else (buffers, states, handles live with their owners)
    assert {f.name for f in dataclasses.fields(Bucket)} == {
        "index", "slots", "start", "numel", "padded_numel", "chunk", "shard_offset", "persistent", "group"
    }  # fmt: skip
    assert {f.name for f in dataclasses.fields(FlatGroup)} == {
        "index", "group_index", "dtype", "partitions", "rank", "buckets", "device", "key", "slots", "numel",
        "padded_numel", "shard_numel",
    }  # fmt: skip
    assert [b.index for b in fg.buckets] == [3, 4] and all(b.group is fg for b in fg.buckets)
    assert fg.key == "group0" and fg.names == ["p0", "p1", "p2", "p3"]
    # buckets [p0] (104, chunk 52) and [p1 p2 p3] (111 -> 112, chunk 56); each parameter's piece of a rank's
    # shard (slot, shard start, shard end), in shard order
    assert fg.slot_pieces() == [(0, 0, 52), (2, 52, 100), (3, 100, 107)]
    assert fg.slot_pieces(0) == [(0, 0, 52), (1, 52, 65), (2, 65, 108)]


def test_layout_json_round_trip_and_errors_name_the_field():
    params = _params(5, 3, 8)
    order = {id(p): i for i, (_, p) in enumerate(params)}
    fg = build_flat_group(2, 1, torch.bfloat16, 3, 0, [params[:2], params[2:]], [True, True], 0, order)
    doc = json.loads(json.dumps(fg.to_dict()))
    assert doc["buckets"][1] == {"params": [{"name": "p2", "shape": [8], "dtype": "bfloat16", "offset": 0}],
                                 "numel": 8, "padded_numel": 9}  # fmt: skip
    back = FlatGroup.from_dict(doc, index=2)
    assert back.same_layout(fg) and back.to_dict() == fg.to_dict() and back.dtype == torch.bfloat16
    assert [(s.offset, s.bucket_offset) for s in back.slots] == [(s.offset, s.bucket_offset) for s in fg.slots]
    assert not back.same_layout(FlatGroup.from_dict(dict(doc, world_size=1)))
    with pytest.raises(LayoutError, match="flat group 'group2': malformed layout: KeyError: 'padded_numel'"):
        FlatGroup.from_dict(dict(doc, buckets=[{"params": [], "numel": 0}]))
    with pytest.raises(LayoutError, match="flat group 'group2' bucket 0: parameters end at 8 > numel 7"):
        FlatGroup.from_dict(dict(doc, buckets=[dict(doc["buckets"][0], numel=7, padded_numel=9)] + doc["buckets"][1:]))
