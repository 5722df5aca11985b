"""Shard sizes and names of a consolidated state dict, as huggingface_hub and transformers read and write them."""

import pytest
import torch

from zero_core.checkpoint.shards import parse_size, plan_shards, shard_names


def test_sizes_read_as_huggingface_hub_reads_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size("1.5KB") == 1500
    assert parse_size(1234) == 1234 and parse_size(None) is None
    for bad in ("5 GiGs", "GB", "-1GB", 0, True, 2.5):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


def test_shards_keep_order_and_a_large_tensor_alone():
    specs = [("a", torch.float32, (10,)), ("b", torch.float32, (30,)), ("c", torch.float32, (5,)),
             ("d", torch.int64, (2,))]  # fmt: skip
    groups = plan_shards(specs, 64)  # 40, 120, 20, 16 bytes
    assert [[s[0] for s in g] for g in groups] == [["a"], ["b"], ["c", "d"]]
    assert plan_shards(specs, None) == [specs]
    assert shard_names("model.safetensors", 3)[1] == "model-00002-of-00003.safetensors"
    assert shard_names("pytorch_model.bin", 1) == ["pytorch_model.bin"]
