"""Config keys of features that are validated: offload (optimizer and parameter offload; auto),
activation checkpointing (plain recomputation only), communication_data_type, ZeRO++ keys (inside zero_optimization
only), fp16 loss scaling."""

import pytest
import torch

from zero.config import ConfigError, NotSupportedError, load_config
from zero.engine.precision import loss_scaler, precision_policy
from zero_comm.testing import run_ranks

BASE = {"train_batch_size": 4}


def _cfg(**extra):
    return load_config({**BASE, **extra}, 2)


def test_param_offload_with_deepcompile_is_not_supported_yet():
    with pytest.raises(NotSupportedError, match=r"zero_optimization\.offload_param' and 'compile\.deepcompile'"):
        _cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
             compile={"deepcompile": True})  # fmt: skip


def test_param_offload_cpu_is_accepted_at_stage_3_only():
    cfg = _cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}})
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert (cfg.zero_optimization.offload_param.pin_memory, cfg.zero_optimization.offload_param.buffer_count) == (
        True, 5)  # DeepSpeed 0.19.8's offload_param defaults  # fmt: skip
    with pytest.raises(ConfigError, match=r"offload_param.*requires stage 3"):
        _cfg(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}})
    with pytest.raises(ConfigError, match=r"offload_param.*zero_hpz_partition_size"):
        _cfg(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}, "zero_hpz_partition_size": 2})


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_optimizer_offload_is_accepted(device):
    cfg = _cfg(zero_optimization={"stage": 3, "offload_optimizer": {"device": device, "nvme_path": "/tmp"}})
    assert cfg.zero_optimization.offload_optimizer.device == device


def test_offload_device_none_and_deprecated_cpu_offload():
    cfg = _cfg(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}})
    assert cfg.zero_optimization.offload_optimizer.device == "none"
    with pytest.warns(UserWarning, match="cpu_offload"):
        cfg = _cfg(zero_optimization={"stage": 2, "cpu_offload": True})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"


def test_zeropp_keys_pass_through_to_zero_core():
    zo = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}
    cfg = _cfg(zero_optimization=zo)
    z = cfg.zero_optimization
    assert (z.zero_quantized_weights, z.zero_quantized_gradients, z.zero_hpz_partition_size) == (True, True, 2)


def test_quantized_nontrainable_weights_stage3_and_ignored_below():
    z = _cfg(zero_optimization={"stage": 3, "zero_quantized_nontrainable_weights": True}).zero_optimization
    assert z.zero_quantized_nontrainable_weights is True
    with pytest.warns(UserWarning, match="zero_quantized_nontrainable_weights has no effect at stage 2"):
        _cfg(zero_optimization={"stage": 2, "zero_quantized_nontrainable_weights": True})


def _init_with_key(how):
    import zero as deepspeed
    from zero_core.frozen_quant import asked_int8

    kwargs = {"zero_quantized_nontrainable_weights": True} if how == "keyword" else {}
    if how == "config":
        kwargs["config_dict_or_path"] = {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}
    with deepspeed.zero.Init(**kwargs):
        model = torch.nn.Linear(4, 4)
    with deepspeed.zero.Init():
        plain = torch.nn.Linear(4, 4)
    return asked_int8(model.weight), asked_int8(plain.weight)


@pytest.mark.parametrize("how", ["keyword", "config"])
def test_zero_init_accepts_quantized_nontrainable_weights(how):
    # DeepSpeed's Init takes the keyword or reads the key from its config; the stage-3 runtime then holds the
    # frozen ones int8 (zero-core's test_stage3_frozen_quant runs the model)
    assert run_ranks(_init_with_key, 1, how, timeout=60) == [(True, False)]


@pytest.mark.parametrize("key", ["zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size",
                                 "zero_quantized_nontrainable_weights"])  # fmt: skip
def test_zeropp_key_at_top_level_names_its_section(key):
    with pytest.raises(ConfigError, match=rf"'{key}' belongs inside 'zero_optimization'"):
        _cfg(**{key: True})


def test_activation_checkpointing_plain_recompute_is_accepted():
    cfg = _cfg(activation_checkpointing={"partition_activations": False, "cpu_checkpointing": False,
                                         "contiguous_memory_optimization": False, "number_checkpoints": 4})  # fmt: skip
    assert cfg.activation_checkpointing.number_checkpoints == 4


@pytest.mark.parametrize("key", ["partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                                 "synchronize_checkpoint_boundary", "profile"])  # fmt: skip
def test_activation_checkpointing_options_are_accepted(key):
    assert getattr(_cfg(activation_checkpointing={key: True}).activation_checkpointing, key) is True


def test_activation_checkpointing_typo_names_the_key():
    with pytest.raises(ConfigError, match="activation_checkpointing.partition_activation'.*partition_activations"):
        _cfg(activation_checkpointing={"partition_activation": False})


def test_communication_data_type_sets_reduce_dtype():
    assert precision_policy(_cfg(communication_data_type="fp32"), "cpu").reduce == torch.float32
    bf = precision_policy(_cfg(bf16={"enabled": True}, communication_data_type="fp32"), "cuda")
    assert (bf.param_dtype, bf.compute, bf.reduce) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert precision_policy(_cfg(bf16={"enabled": True}), "cuda").reduce == torch.bfloat16
    assert precision_policy(_cfg(communication_data_type="bf16"), "cpu").reduce == torch.bfloat16
    with pytest.raises(ConfigError, match="communication_data_type.*'int8'.*'fp32'"):
        _cfg(communication_data_type="int8")


NO_BF16 = frozenset({"avx2", "fma"})  # the Zen 3 of baselines.md
AMX = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16"})


@pytest.mark.parametrize(("device", "flags", "compute"), [
    ("cuda", NO_BF16, torch.bfloat16),
    ("cpu", NO_BF16, torch.float32),
    ("cpu", frozenset({"avx512_bf16"}), torch.bfloat16),
    ("cpu", AMX, torch.bfloat16),
    ("cpu", frozenset(), torch.float32),
])  # fmt: skip
def test_bf16_compute_follows_the_hardware(device, flags, compute):
    p = precision_policy(_cfg(bf16={"enabled": True}), device, flags)
    assert (p.param_dtype, p.compute, p.reduce, p.master_dtype, p.accum) == (
        torch.bfloat16, compute, torch.bfloat16, torch.float32, torch.float32)  # fmt: skip


def test_fp16_compute_follows_the_hardware():
    cfg = _cfg(fp16={"enabled": True})
    assert precision_policy(cfg, "cuda", NO_BF16).compute == torch.float16
    assert precision_policy(cfg, "cpu", AMX).compute == torch.float32  # avx512_fp16 alone: no faster than fp32
    assert precision_policy(cfg, "cpu", AMX | {"amx_fp16"}).compute == torch.float16
    assert precision_policy(cfg, "cpu", NO_BF16).param_dtype == torch.float16


def test_fp32_policy_by_default():
    p = precision_policy(_cfg(), "cpu")
    assert (p.param_dtype, p.compute, p.reduce) == (torch.float32,) * 3


def test_fp16_loss_scaler_from_config():
    assert loss_scaler(_cfg()) is None and loss_scaler(_cfg(bf16={"enabled": True})) is None
    static = loss_scaler(_cfg(fp16={"enabled": True, "loss_scale": 128}))
    assert static.scale == 128.0
    dyn = loss_scaler(_cfg(fp16={"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 1,
                                 "min_loss_scale": 2, "consecutive_hysteresis": True}))  # fmt: skip
    assert (dyn.scale, dyn.scale_window, dyn.hysteresis, dyn.min_scale, dyn.consecutive_hysteresis) == (
        16.0, 2, 1, 2.0, True)  # fmt: skip
    dyn.update(True)  # hysteresis 1: halve at once
    assert dyn.scale == 8.0
    for _ in range(2):
        dyn.update(False)
    assert dyn.scale == 8.0  # DeepSpeed counts the clean steps before this one: 0, then 1
    dyn.update(False)
    assert dyn.scale == 16.0  # 2 clean steps before this one: a full loss_scale_window, doubled
    for _ in range(5):
        dyn.update(True)
    assert dyn.scale == 2.0  # never below min_loss_scale


def test_offload_auto_resolves_to_defaults_and_is_printed():
    from zero.config.offload_auto import describe_offload

    zo = {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": "auto", "buffer_count": "auto"},
        "offload_param": {"device": "cpu", "max_in_cpu": "auto", "pin_memory": "auto", "buffer_size": "auto"},
    }
    cfg = _cfg(zero_optimization=zo)
    opt, prm = cfg.zero_optimization.offload_optimizer, cfg.zero_optimization.offload_param
    can_pin = torch.cuda.is_available()  # pin_memory "auto": whether this machine can pin
    assert (opt.pin_memory, opt.buffer_count) == (can_pin, 4)
    assert (prm.pin_memory, prm.max_in_cpu, prm.buffer_size) == (can_pin, 10**9, 10**8)
    line = describe_offload(cfg)
    assert f"pin_memory={can_pin!r} (auto)" in line and "max_in_cpu=1000000000 (auto)" in line
    assert "offload_param: device='cpu'" in line and "ratio=1.0," in line  # given or default: not marked
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage.*auto"):
        _cfg(zero_optimization={"stage": "auto"})
