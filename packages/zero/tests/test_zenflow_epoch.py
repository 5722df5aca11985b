"""ZenFlow's epoch: ``zero.initialize`` fills ``zenflow.steps_per_epoch`` from ``training_data`` in optimizer steps
when columns are re-selected per epoch, as DeepSpeed fills it from its training dataloader (over a set value)."""

import pytest
import torch

from zero.config import ConfigError, load_config
from zero.engine.data import build_dataloader
from zero.initialize import _zenflow_steps_per_epoch


def _cfg(zenflow: dict):
    return load_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                              "zenflow": zenflow}})  # fmt: skip


def test_steps_per_epoch_comes_from_the_training_data():
    loader = build_dataloader(torch.utils.data.TensorDataset(torch.arange(40)), 4, 0, 1)  # 10 micro-batches
    auto = _cfg({"update_interval": 2})
    _zenflow_steps_per_epoch(auto, loader)
    zen = auto.zero_optimization.zenflow
    assert (zen.steps_per_epoch, zen.select_steps) == (5, 5)  # 10 micro-batches / 2 accumulation steps
    epoch = _cfg({"select_strategy": "epoch", "select_interval": 3, "steps_per_epoch": 99})
    _zenflow_steps_per_epoch(epoch, loader)
    assert epoch.zero_optimization.zenflow.select_steps == 15  # 3 epochs of 5 steps; the set 99 is replaced
    step = _cfg({"select_strategy": "step", "select_interval": 7})
    _zenflow_steps_per_epoch(step, loader)
    assert step.zero_optimization.zenflow.steps_per_epoch is None and step.zero_optimization.zenflow.select_steps == 7
    without = _cfg({})
    _zenflow_steps_per_epoch(without, None)  # no training data: columns are selected once
    assert without.zero_optimization.zenflow.select_steps == 0
    with pytest.raises(ConfigError, match="zenflow.*steps_per_epoch 5.*update_interval"):
        _zenflow_steps_per_epoch(_cfg({"update_interval": 8}), loader)
