"""ZeroConfig validation (bucket and prefetch sizes) and the precision policy / loss scaler units."""

import warnings

import pydantic
import pytest
import torch

from zero_core import DynamicLossScaler, PrecisionPolicy, ZeroConfig

SIZE_FIELDS = ["reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size"]


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", [0, -1, 1.5, "abc", True, float("nan")])
def test_bad_bucket_sizes_rejected_naming_the_field(field, value):
    if field == "stage3_prefetch_bucket_size" and value == 0:
        assert ZeroConfig(stage=3, **{field: value}).stage3_prefetch_bucket_size == 0  # DeepSpeed's "no prefetch"
        return
    with pytest.raises(pydantic.ValidationError) as err:
        ZeroConfig(stage=2, **{field: value})
    assert field in str(err.value)


@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_integral_floats_accepted_as_int(field):
    cfg = ZeroConfig(**{field: 1.5e8})
    assert getattr(cfg, field) == 150_000_000 and isinstance(getattr(cfg, field), int)


def test_unknown_key_rejected():
    with pytest.raises(pydantic.ValidationError, match="reduce_bucket_sise"):
        ZeroConfig.model_validate({"stage": 2, "reduce_bucket_sise": 10})


def test_deepspeed_json_and_deprecated_keys():
    cfg = ZeroConfig.model_validate({
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 0, "stage3_gather_fp16_weights_on_model_save": True,
        "cpu_offload": True, "offload_param": {"device": "cpu", "pin_memory": True},
    })  # fmt: skip
    assert cfg.stage3_gather_16bit_weights_on_model_save is True
    assert cfg.offload_optimizer.device == "cpu" and cfg.offload_param.pin_memory
    assert cfg.stage3_param_persistence_threshold == 0
    assert ZeroConfig(stage=3).overlap and not ZeroConfig(stage=2).overlap


def test_precision_policy_resolution_and_errors():
    p = PrecisionPolicy.bf16()
    assert (p.param_dtype, p.compute, p.reduce, p.master_dtype, p.accum) == (
        torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.float32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="reduce_dtype"):
        PrecisionPolicy(reduce_dtype=torch.int8)


def test_dynamic_loss_scaler_deepspeed_semantics():
    s = DynamicLossScaler.from_deepspeed(initial_scale_power=4, loss_scale_window=2, hysteresis=2, min_loss_scale=1)
    trace = []
    for overflow in [False, False, True, True, False, False, True]:
        s.update(overflow)
        trace.append((s.scale, s.cur_hysteresis))
    # DeepSpeed grows when the good iterations before this one since the last overflow (cur_iter - last - 1) are a
    # positive multiple of the window: iter0: 0, iter1: 1 -> no growth; iter2 overflow, hysteresis 2 -> 1; iter3
    # overflow -> /2; iter4: 0, iter5: 1 -> no growth; iter6 overflow with hysteresis 1 -> /2.
    assert trace == [(16, 2), (16, 2), (16, 1), (8, 1), (8, 1), (8, 1), (4, 1)]
    assert s.skipped_steps == 3
    t = DynamicLossScaler.from_deepspeed(4, 2, 2)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_allgather_bucket_size_warns_it_has_no_effect():
    with pytest.warns(UserWarning, match="allgather_bucket_size=1000 has no effect"):
        ZeroConfig(stage=2, allgather_bucket_size=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not set: nothing to say
        ZeroConfig(stage=2, reduce_bucket_size=1000, stage3_max_reuse_distance=0)
