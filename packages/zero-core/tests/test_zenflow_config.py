"""``zero_optimization.zenflow``: DeepSpeed 0.19.8's keys and defaults, bad values refused naming the field, and the
section refused without ``offload_optimizer`` cpu at stage 1 or 2 (naming both keys)."""

import pydantic
import pytest

from zero_core import ZenFlowConfig, ZeroConfig


def _zero(zenflow, stage=2, offload=None):
    section = {"stage": stage, "offload_optimizer": offload or {"device": "cpu"}, "zenflow": zenflow}
    return ZeroConfig.model_validate(section)


def test_defaults_are_deepspeeds():
    z = _zero({}).zenflow
    assert z.model_dump() == {"topk_ratio": 0.1, "select_strategy": "auto", "select_interval": "auto",
                              "update_interval": "auto", "overlap_step": False, "offload": False,
                              "auto_ratio": 0.99, "full_warm_up_rounds": 0, "pt_reserved_cores_perc": 0.5,
                              "steps_per_epoch": None}  # fmt: skip
    assert z.select_steps == 0  # "auto" (every epoch) without steps_per_epoch: select once
    assert ZenFlowConfig(steps_per_epoch=50).select_steps == 50
    assert ZenFlowConfig(select_strategy="epoch", select_interval=2, steps_per_epoch=50).select_steps == 100
    step = ZenFlowConfig(select_strategy="step", select_interval=8.0, update_interval=4, topk_ratio=1.0)
    assert (step.select_steps, step.update_interval) == (8, 4) and isinstance(step.select_interval, int)
    assert ZeroConfig(stage=1).zenflow is None


@pytest.mark.parametrize(
    "field, value",
    [("topk_ratio", 0.0), ("topk_ratio", 1.5), ("topk_ratio", "x"), ("select_strategy", "often"),
     ("select_interval", "sometimes"), ("update_interval", 0), ("update_interval", "never"),
     ("update_interval", True), ("update_interval", 2.5), ("overlap_step", "maybe"), ("auto_ratio", 1.5),
     ("full_warm_up_rounds", -1), ("full_warm_up_rounds", 1.5), ("pt_reserved_cores_perc", -0.1),
     ("steps_per_epoch", 0), ("topk", 0.2)],
)  # fmt: skip
def test_bad_values_name_the_field(field, value):
    with pytest.raises(pydantic.ValidationError) as err:
        _zero({field: value})
    assert field in str(err.value)


@pytest.mark.parametrize(
    "zenflow, field",
    [({"select_interval": 4}, "select_interval"), ({"select_strategy": "step"}, "select_interval"),
     ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, "update_interval"),
     ({"select_strategy": "epoch", "select_interval": 1, "steps_per_epoch": 3, "update_interval": 4},
      "update_interval")],
)  # fmt: skip
def test_inconsistent_intervals_name_both_fields(zenflow, field):
    with pytest.raises(pydantic.ValidationError) as err:
        _zero(zenflow)
    assert "select_interval" in str(err.value) and field in str(err.value)


@pytest.mark.parametrize(
    "stage, offload, needle",
    [(2, {"device": "none"}, "offload_optimizer.device"), (2, {"device": "nvme", "nvme_path": "/tmp"}, "'nvme'"),
     (3, None, "stage 3"), (2, {"device": "cpu", "super_offload": True}, "offload_optimizer.super_offload"),
     (1, {"device": "cpu", "ratio": 0.5}, "offload_optimizer.ratio")],
)  # fmt: skip
def test_needs_cpu_offload_at_stage_1_or_2(stage, offload, needle):
    with pytest.raises(pydantic.ValidationError) as err:
        _zero({}, stage=stage, offload=offload)
    assert "zenflow" in str(err.value) and needle in str(err.value)
    with pytest.raises(pydantic.ValidationError, match="offload_optimizer.device"):
        ZeroConfig.model_validate({"stage": 2, "zenflow": {}})
