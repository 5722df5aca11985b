"""Offload config keys: DeepSpeed's names and defaults; bad input named by key before any rank starts."""

import pydantic
import pytest
import torch

from zero_core.config import OffloadConfig, ZeroConfig


def test_deepspeed_defaults():
    c = OffloadConfig(device="cpu")
    assert (c.pin_memory, c.ratio, c.super_offload, c.cpuadam_cores_perc, c.buffer_count) == (False, 1.0, False, 0.8, 4)


@pytest.mark.parametrize(
    "section,match",
    [
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer.device='cpu' requires stage 1"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param.device='cpu' requires stage 3"),
        ({"stage": 1, "offload_param": {"device": "nvme", "nvme_path": "/x"}}, "offload_param.device='nvme'"),
        ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device"),
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "nvme_path"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "ratio"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "cpuadam_cores_perc": 0}}, "cpuadam_cores_perc"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memry": True}}, "pin_memry"),
    ],
)
def test_bad_input_names_the_key(section, match):
    with pytest.raises(pydantic.ValidationError, match=match):
        ZeroConfig.model_validate(section)


def test_device_none_is_accepted_at_any_stage():
    ZeroConfig.model_validate(
        {"stage": 0, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}
    )


def test_report_lists_offload_paths(tmp_path):
    from zero_offload.availability import offload_paths

    rows = dict(offload_paths(str(tmp_path)))
    assert rows["offload_optimizer cpu"].startswith("available")
    assert str(tmp_path) in rows["offload_optimizer nvme"]
    assert rows["offload_param cpu"].startswith("available")
    assert ("falls back" in rows["pin_memory"]) != torch.cuda.is_available()
