"""Config loading: DeepSpeed key names, derivation of the batch triple, and one-line errors naming the key."""

import json
import warnings

import pytest

from zero.config import ConfigError, NotSupportedError, load_config


def _err(cfg, world_size=2, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(cfg, world_size, **kw)
    return str(info.value)


# --- batch triple: global = micro x gas x world size ------------------------------------------------------------------
@pytest.mark.parametrize("ws", [2, 3])
def test_consistent_batch_triple_accepted(ws):
    b = load_config({"train_batch_size": 4 * 3 * ws, "train_micro_batch_size_per_gpu": 4,
                     "gradient_accumulation_steps": 3}, ws).batch  # fmt: skip
    assert (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps) == (12 * ws, 4, 3)


@pytest.mark.parametrize("ws", [2, 3])
def test_inconsistent_batch_triple_names_all_numbers(ws):
    msg = _err({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, ws)
    for text in ("train_batch_size=100", "train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=3",
                 f"world size {ws}"):  # fmt: skip
        assert text in msg


@pytest.mark.parametrize("ws", [2, 3])
def test_batch_triple_derivations(ws):
    only_global = load_config({"train_batch_size": 6 * ws}, ws).batch
    assert (only_global.micro_batch_per_gpu, only_global.gradient_accumulation_steps) == (6, 1)
    only_micro = load_config({"train_micro_batch_size_per_gpu": 5}, ws).batch
    assert (only_micro.train_batch_size, only_micro.gradient_accumulation_steps) == (5 * ws, 1)
    micro_gas = load_config({"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 4}, ws).batch
    assert micro_gas.train_batch_size == 20 * ws
    global_micro = load_config({"train_batch_size": 12 * ws, "train_micro_batch_size_per_gpu": 3}, ws).batch
    assert global_micro.gradient_accumulation_steps == 4
    for b in (only_global, only_micro, micro_gas, global_micro):
        assert b.train_batch_size == b.micro_batch_per_gpu * b.gradient_accumulation_steps * ws


def test_batch_global_and_gas_not_divisible_by_world_size():
    msg = _err({"train_batch_size": 10, "gradient_accumulation_steps": 2}, 3)
    assert "train_batch_size=10" in msg and "world size 3" in msg


@pytest.mark.parametrize("key", ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"])
@pytest.mark.parametrize("value", [0, -4])
def test_batch_sizes_zero_or_negative_rejected(key, value):
    cfg = {"train_micro_batch_size_per_gpu": 2, key: value}
    assert f"'{key}': got {value}" in _err(cfg)


def test_batch_missing_entirely():
    assert "train_batch_size" in _err({"gradient_accumulation_steps": 2})


# --- bucket sizes -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["reduce_bucket_size", "allgather_bucket_size"])
@pytest.mark.parametrize("value", [0, -1, "abc", 1.5])
def test_invalid_bucket_sizes_name_the_field(field, value):
    # Policy: bucket sizes are element counts; fractional values are rejected, integral floats (2e8) accepted.
    msg = _err({"train_batch_size": 2, "zero_optimization": {"stage": 0, field: value}})
    assert f"zero_optimization.{field}" in msg


def test_integral_float_bucket_size_accepted():
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"reduce_bucket_size": 2e8}}, 2)
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000


# --- typos, bad values, unsupported features, "auto", deprecated keys ----------------------------------------------
def test_unknown_top_level_key_suggests_nearest():
    msg = _err({"train_batch_size": 2, "gradient_clippping": 1.0})
    assert "'gradient_clippping'" in msg and "did you mean 'gradient_clipping'" in msg


def test_unknown_nested_key_suggests_nearest():
    msg = _err({"train_batch_size": 2, "zero_optimization": {"stgae": 1}})
    assert "zero_optimization.stgae" in msg and "'stage'" in msg


def test_unknown_optimizer_param_suggests_nearest():
    msg = _err({"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"weigth_decay": 0.1}}})
    assert "optimizer.params.weigth_decay" in msg and "'weight_decay'" in msg


def test_bad_value_names_key_value_and_allowed():
    msg = _err({"train_batch_size": 2, "fp16": {"enabled": True, "loss_scale_window": "abc"}})
    assert "fp16.loss_scale_window" in msg and "'abc'" in msg and "integer" in msg


def test_bad_optimizer_and_scheduler_types():
    assert "did you mean 'SGD'" in _err({"train_batch_size": 2, "optimizer": {"type": "SDG"}})
    msg = _err({"train_batch_size": 2, "scheduler": {"type": "WarmupLr", "params": {}}})
    assert "scheduler.type" in msg and "WarmupLR" in msg
    msg = _err({"train_batch_size": 2, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "cubic"}}})
    assert "scheduler.params.total_num_steps" in msg and "scheduler.params.warmup_type" in msg


def test_fp16_and_bf16_together_rejected():
    assert "choose one" in _err({"train_batch_size": 2, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_negative_gradient_clipping_rejected():
    assert "gradient_clipping" in _err({"train_batch_size": 2, "gradient_clipping": -1})


@pytest.mark.parametrize("key", ["pipeline", "moe", "sparse_attention", "elasticity"])
def test_features_zero_lacks_are_not_supported_yet(key):
    with pytest.raises(NotSupportedError, match=f"'{key}'.*not supported yet"):
        load_config({"train_batch_size": 2, key: {"enabled": True}}, 2)


def test_disabled_unsupported_section_is_accepted():
    load_config({"train_batch_size": 2, "elasticity": {"enabled": False}}, 2)


def test_unsupported_optimizer_type():
    with pytest.raises(NotSupportedError, match="optimizer.type.*MuonWithAuxAdam"):
        load_config({"train_batch_size": 2, "optimizer": {"type": "MuonWithAuxAdam", "params": {}}}, 2)


def test_auto_filled_by_caller_and_unfilled_is_error():
    cfg = {"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    filled = load_config(cfg, 2, auto_values={"train_batch_size": 8, "optimizer.params.lr": 3e-4})
    assert filled.batch.train_batch_size == 8 and filled.optimizer.params["lr"] == 3e-4
    assert "'optimizer.params.lr' is \"auto\" but nothing filled it" in _err(cfg, auto_values={"train_batch_size": 8})
    assert "not accepted here" in _err({"train_batch_size": 2, "steps_per_print": "auto"})


def test_auto_as_a_value_passes_to_the_core():
    # stage3_shared_shards: "auto" is the key's own value (zero-core decides at wrap time), not a placeholder.
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_shared_shards": "auto"}}, 2)
    assert cfg.zero_optimization.stage3_shared_shards == "auto"
    assert "stage3_shared_shards" in _err(
        {"train_batch_size": 2, "zero_optimization": {"stage": 3, "stage3_shared_shards": "sometimes"}}
    )
    # DeepSpeed's ZenFlow tutorial config: "auto" is a value of its own in the nested zenflow section too
    zenflow = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto", "update_interval": 4,
               "full_warm_up_rounds": 0, "overlap_step": True}  # fmt: skip
    zo = {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}
    got = load_config({"train_batch_size": 2, "zero_optimization": zo}, 2).zero_optimization.zenflow
    assert (got.select_strategy, got.select_interval, got.update_interval, got.topk_ratio) == ("auto", "auto", 4, 0.05)
    auto = load_config({"train_batch_size": 2, "zero_optimization": {**zo, "zenflow": {"update_interval": "auto"}}}, 2)
    assert auto.zero_optimization.zenflow.update_interval == "auto"
    assert "not accepted here" in _err(
        {"train_batch_size": 2, "zero_optimization": {**zo, "zenflow": {"topk_ratio": "auto"}}}
    )


def test_deprecated_keys_migrate_with_warning():
    cfg = {"train_batch_size": 2, "bfloat16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = load_config(cfg, 2)
    assert out.bf16.enabled and any("'bfloat16' is deprecated" in str(w.message) for w in caught)


def test_from_json_path_and_bad_paths(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}))
    assert load_config(str(good), 2).batch.train_batch_size == 12
    assert "does not exist" in _err(str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert "not valid JSON" in _err(str(broken))
