"""Dotted top-level keys (what TRL's ``prepare_deepspeed`` writes for its reference model at ZeRO-3) are accepted
and ignored as DeepSpeed 0.19.8 does; unknown keys get one short line naming the key and its nearest names."""

import pytest

from zero.config import ConfigError, load_config

TRL_KEYS = {"zero_optimization.reduce_bucket_size": 64 * 64,
            "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
            "zero_optimization.stage3_prefetch_bucket_size": 0.9 * 64 * 64}  # fmt: skip


def test_trl_dotted_keys_are_accepted_and_have_no_effect_as_in_deepspeed():
    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}
    with pytest.warns(UserWarning, match="zero_optimization.reduce_bucket_size"):
        cfg = load_config({**base, **TRL_KEYS})
    plain = load_config(base)
    assert cfg.zero_optimization == plain.zero_optimization
    assert cfg.zero_optimization.reduce_bucket_size == 1000  # the nested value runs, as in DeepSpeed


def test_dotted_key_naming_no_field_is_a_short_error_with_the_nearest_name():
    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization.reduce_bucket_sise": 5})
    msg = str(err.value)
    assert "'zero_optimization.reduce_bucket_sise'" in msg and "did you mean 'reduce_bucket_size'" in msg
    assert len(msg) < 200


@pytest.mark.parametrize("raw", [{"qqqqqq_zzzz": 1}, {"zero_optimization": {"qqqqqq_zzzz": 1}}])
def test_unknown_key_without_a_close_match_names_three_nearest_keys_not_the_whole_section(raw):
    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": 1, **raw})
    msg = str(err.value)
    assert "unknown config key" in msg and "qqqqqq_zzzz" in msg and "nearest valid keys: " in msg
    assert msg.split("nearest valid keys: ")[1].count(",") == 2
    assert len(msg) < 200
