"""The `compile` (DeepCompile) and `torch_compile` config sections: DeepSpeed 0.19.8's keys and defaults, the
mutual exclusions as errors naming both keys, and "not supported yet" for DeepCompile features zero lacks."""

from __future__ import annotations

import pytest

from zero.config import load_config
from zero.config.errors import ConfigError, NotSupportedError


def _cfg(compile_section=None, stage=3, **extra):
    raw = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, **extra}
    if compile_section is not None:
        raw["compile"] = compile_section
    return load_config(raw, world_size=2)


def test_defaults_are_deepspeeds():
    c = _cfg().compile
    assert (c.deepcompile, c.double_buffer, c.debug_log, c.keep_int_input_tensors, c.keep_all_input_tensors) == (
        False, True, False, True, False)  # fmt: skip
    assert (c.offload_parameters, c.offload_opt_states, c.offload_activation, c.free_activation) == (False,) * 4
    assert c.free_activation_threshold == 10 * 1024 * 1024 and c.passes is None
    assert (c.sync_before_reduce, c.sync_after_reduce, c.sync_before_allgather, c.sync_after_allgather) == (False,) * 4
    t = _cfg().torch_compile
    assert (t.enabled, t.backend) == (False, "inductor")


def test_deepcompile_section_loads():
    c = _cfg({"deepcompile": True, "passes": ["z3"], "debug_log": True, "backend": "aot_eager"}).compile
    assert c.deepcompile and c.passes == ["z3"] and c.backend == "aot_eager"
    assert _cfg({"deepcompile": True, "passes": ["z1"]}, stage=1).compile.passes == ["z1"]


@pytest.mark.parametrize(
    "section, extra, keys",
    [
        ({"offload_activation": True, "offload_parameters": True}, {}, ("offload_activation", "offload_parameters")),
        ({"offload_activation": True, "offload_opt_states": True}, {}, ("offload_activation", "offload_opt_states")),
        ({"offload_parameters": True, "offload_opt_states": True}, {}, ("offload_parameters", "offload_opt_states")),
        ({"deepcompile": True}, {"torch_compile": {"enabled": True}}, ("compile.deepcompile", "torch_compile.enabled")),
        ({"deepcompile": True, "passes": ["z1"]}, {}, ("compile.passes", "zero_optimization.stage")),
    ],
)
def test_mutual_exclusions_name_both_keys(section, extra, keys):
    with pytest.raises(ConfigError) as err:
        _cfg(section, **extra)
    assert not isinstance(err.value, NotSupportedError)
    for k in keys:
        assert k in str(err.value)


def test_offload_opt_states_excludes_offload_optimizer():
    with pytest.raises(ConfigError, match="compile.offload_opt_states and zero_optimization.offload_optimizer"):
        zo = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
        load_config({"train_batch_size": 2, "compile": {"offload_opt_states": True}, "zero_optimization": zo}, 2)


@pytest.mark.parametrize("key", ["offload_parameters", "offload_activation", "free_activation", "sync_after_reduce"])
def test_features_not_built_yet_are_named(key):
    with pytest.raises(NotSupportedError, match=f"compile.{key}.*not supported yet"):
        _cfg({"deepcompile": True, key: True})


def test_deepcompile_needs_a_zero_stage_and_knows_its_keys():
    with pytest.raises(ConfigError, match="stage 1, 2 or 3"):
        _cfg({"deepcompile": True}, stage=0)
    with pytest.raises(ConfigError, match="compile.deep_compile"):
        _cfg({"deep_compile": True})
    with pytest.raises(ConfigError, match=r"\['autotp'\] needs config key 'tensor_parallel.autotp_size' > 1"):
        _cfg({"deepcompile": True, "passes": ["autotp"]})


def test_offload_opt_states_is_built_with_a_budget():
    c = _cfg({"deepcompile": True, "offload_opt_states": True, "opt_states_budget_bytes": 4096}).compile
    assert c.offload_opt_states and c.opt_states_budget_bytes == 4096
    assert _cfg().compile.opt_states_budget_bytes == 0


def test_deepcompile_refuses_int8_frozen_weights_at_stage3():
    raw = {"train_batch_size": 2, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True},
           "compile": {"deepcompile": True}}  # fmt: skip
    with pytest.raises(NotSupportedError, match="compile.deepcompile with zero_optimization.zero_quantized_nontr"):
        load_config(raw, world_size=2)


def test_autosp_runs_alone_at_stage_0_or_1():
    """DeepSpeed runs its AutoSP backend instead of the ZeRO passes and only at stages 0 and 1: zero loads
    ["autosp"] there and names the key of every other combination."""
    for stage in (0, 1):
        c = _cfg({"deepcompile": True, "passes": ["autosp"], "backend": "aot_eager"}, stage=stage).compile
        assert c.passes == ["autosp"]
    with pytest.raises(ConfigError, match=r"compile.passes \['z1', 'autosp'\]: 'autosp' runs alone"):
        _cfg({"deepcompile": True, "passes": ["z1", "autosp"]}, stage=1)
    for stage in (2, 3):
        with pytest.raises(NotSupportedError, match=f"'zero_optimization.stage': {stage} with compile.passes"):
            _cfg({"deepcompile": True, "passes": ["autosp"]}, stage=stage)
    with pytest.raises(NotSupportedError, match="'compile.offload_opt_states': true with compile.passes"):
        _cfg({"deepcompile": True, "passes": ["autosp"], "offload_opt_states": True}, stage=1)
    with pytest.raises(NotSupportedError, match="compile.free_activation.*not supported yet"):
        _cfg({"deepcompile": True, "passes": ["autosp"], "free_activation": True}, stage=1)
