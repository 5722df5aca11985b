"""Pure resharding: N shards -> M shards, stage-2 layout <-> stage-3 layout, exact; refusals name both layouts."""

import json

import pytest
import torch

from zero_core.checkpoint import (
    CheckpointLayout,
    DictShardSource,
    FlatGroup,
    LayoutMismatchError,
    build_shard,
    read_param,
    reshard,
)
from zero_core.checkpoint.codec import UnsupportedStateError, decode, encode

# Uneven sizes: no world size in 2..4 divides the group totals, so every shard set is padded.
PARAMS = {"a.weight": (3, 5), "a.bias": (3,), "b.weight": (7, 3), "b.bias": (7,), "c.weight": (2, 7)}
OPTIM_GROUP = {"a.weight": 0, "a.bias": 1, "b.weight": 0, "b.bias": 1, "c.weight": 0}


def _group(key, names, world, optim_group, bucketed=False):
    """One bucket, or (``bucketed``) one bucket per parameter, as zero_core's bucketed flat groups."""
    buckets = [[(n, PARAMS[n])] for n in names] if bucketed else [[(n, PARAMS[n]) for n in names]]
    return FlatGroup.of(key, optim_group, world, buckets)


def stage2_layout(world):
    """One buffer per optimizer param group (stages 1/2)."""
    groups = [_group(f"g{i}", [n for n in PARAMS if OPTIM_GROUP[n] == i], world, i) for i in (0, 1)]
    return CheckpointLayout(stage=2, world_size=world, groups=groups)


def stage3_layout(world):
    """One buffer per (module unit, optimizer param group) (stage 3), in a different order."""
    groups = []
    for unit in ("c", "b", "a"):
        for i in (1, 0):
            names = [n for n in PARAMS if n.startswith(unit + ".") and OPTIM_GROUP[n] == i]
            if names:
                groups.append(_group(f"{unit}.g{i}", names, world, i, bucketed=True))
    return CheckpointLayout(stage=3, world_size=world, groups=groups)


def full_values(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in PARAMS.items()}


def shard_files(layout, values, step=3.0):
    """What N ranks would save: master and exp_avg shards per buffer, plus a 0-dim step; padding is NaN."""
    files = []
    for rank in range(layout.world_size):
        d = {}
        for g in layout.groups:
            chunks = []
            for b in g.buckets:
                flat = torch.full((b.padded_numel,), float("nan"))
                for p in b.slots:
                    flat[p.bucket_offset : p.bucket_offset + p.numel] = values[p.name].reshape(-1)
                chunks.append(flat[slice(*b.chunk_range(rank))])
            d[f"master/{g.key}"] = torch.cat(chunks)
            d[f"optim/exp_avg/{g.key}"] = 2 * d[f"master/{g.key}"]
            d[f"optim/step/{g.key}"] = torch.tensor(step)
        files.append(d)
    return files


@pytest.mark.parametrize("src_stage", [2, 3])
@pytest.mark.parametrize("dst_stage", [2, 3])
def test_every_world_size_pair_and_stage_pair_is_exact(src_stage, dst_stage):
    make = {2: stage2_layout, 3: stage3_layout}
    values = full_values()
    for n in range(1, 5):
        saved = make[src_stage](n)
        source = DictShardSource(shard_files(saved, values))
        for m in range(1, 5):
            current = make[dst_stage](m)
            rebuilt = {g.key: [] for g in current.groups}
            for rank in range(m):
                masters, states = reshard(saved, source, current, rank)
                for g in current.groups:
                    assert masters[g.key].shape == (g.shard_numel,)
                    torch.testing.assert_close(states[g.key]["exp_avg"], 2 * masters[g.key], rtol=0, atol=0,
                                               equal_nan=True)  # fmt: skip
                    assert states[g.key]["step"].item() == 3.0
                    rebuilt[g.key].append(masters[g.key])
            for g in current.groups:
                for b in g.buckets:
                    flat = torch.cat([shard[b.shard_slice()] for shard in rebuilt[g.key]])
                    if (n, src_stage) != (m, dst_stage):  # an identical layout keeps its shards bit for bit
                        assert torch.all(flat[b.numel :] == 0), "padding must be zero, not the saved padding"
                    for p in b.slots:
                        got = flat[p.bucket_offset : p.bucket_offset + p.numel].view(p.shape)
                        assert torch.equal(got, values[p.name]), f"{n}->{m} stage {src_stage}->{dst_stage}: {p.name}"


def test_read_param_spans_shards():
    values = full_values(1)
    saved = stage2_layout(4)
    source = DictShardSource(shard_files(saved, values))
    for name in PARAMS:
        assert torch.equal(read_param(saved, source, "master", name).view(PARAMS[name]), values[name])
    assert torch.equal(read_param(saved, source, "master", "b.weight", 4, 17), values["b.weight"].reshape(-1)[4:17])


def test_same_layout_reads_the_shard_whole():
    values = full_values(2)
    saved = stage2_layout(3)
    source = DictShardSource(shard_files(saved, values))
    shard = build_shard(saved, source, "master", saved.groups[0], 2)
    # including its (NaN) padding, bit for bit
    assert torch.equal(shard.view(torch.int32), source.get(2, "master/g0").view(torch.int32))
    assert torch.isnan(shard[-1])


def test_mismatch_names_both_layouts():
    saved = stage2_layout(2)
    other = dict(PARAMS, **{"b.weight": (3, 7)})
    group = FlatGroup.of("x", 1, 4, [[("b.weight", other["b.weight"])]], padded=[24])
    current = CheckpointLayout(stage=3, world_size=4, groups=[group])
    with pytest.raises(LayoutMismatchError) as e:
        reshard(saved, DictShardSource(shard_files(saved, full_values())), current, 0)
    msg = str(e.value)
    assert "stage 2, world size 2" in msg and "stage 3, world size 4" in msg
    assert "b.weight: shape [7, 3] in the checkpoint, [3, 7] in the model" in msg
    assert "optimizer param group 0 in the checkpoint, 1 in the model" in msg
    assert "parameters in the checkpoint but not in the model" in msg


def test_differing_step_between_merged_buffers_is_refused():
    saved = stage3_layout(2)
    files = shard_files(saved, full_values())
    for d in files:
        d["optim/step/b.g0"] = torch.tensor(4.0)
    with pytest.raises(LayoutMismatchError, match="optimizer state 'step' differs"):
        reshard(saved, DictShardSource(files), stage2_layout(2), 0)


def test_layout_validation_names_the_group():
    with pytest.raises(ValueError, match="flat group 'g' bucket 0: padded_numel 7 is not a multiple of world_size 2"):
        FlatGroup.from_dict({"key": "g", "optim_group": 0, "world_size": 2,
                             "buckets": [{"params": [], "numel": 7, "padded_numel": 7}]})  # fmt: skip
    with pytest.raises(ValueError, match="overlaps"):
        slots = [{"name": "x", "shape": [4], "offset": 0}, {"name": "y", "shape": [2], "offset": 2}]
        FlatGroup.from_dict({"key": "g", "optim_group": 0, "world_size": 1,
                             "buckets": [{"params": slots, "numel": 8, "padded_numel": 8}]})  # fmt: skip


def test_codec_round_trips_types_and_refuses_objects():
    obj = {
        "betas": (0.9, 0.95), "lr": 1e-3, "inf": float("inf"), "ints": {1: "a", 2: [None, True]},
        "t": torch.arange(3), "dtype": torch.bfloat16, "s": "x",
    }  # fmt: skip
    tensors = {}
    back = decode(json.loads(json.dumps(encode(obj, tensors, "c"))), tensors)
    assert back["betas"] == (0.9, 0.95) and isinstance(back["betas"], tuple)
    assert back["inf"] == float("inf") and back["ints"] == {1: "a", 2: [None, True]}
    assert torch.equal(back["t"], torch.arange(3)) and back["dtype"] is torch.bfloat16
    with pytest.raises(UnsupportedStateError, match="c/fn: cannot store a value of type builtins.function"):
        encode({"fn": lambda: 0}, {}, "c")


def test_layout_json_round_trip():
    layout = stage3_layout(3)
    back = CheckpointLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert back.same_groups(layout) and back.to_dict() == layout.to_dict()
    assert [g.key for g in back.groups] == [g.key for g in layout.groups]
