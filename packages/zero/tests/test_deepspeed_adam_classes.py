"""A script that builds its optimizer from the config's ``optimizer`` section and checks it against DeepSpeed's Adam
classes (``isinstance(opt, deepspeed.ops.adam.FusedAdam)``) gets DeepSpeed 0.19.8's answer: its engine builds
``FusedAdam`` for type Adam/AdamW, ``DeepSpeedCPUAdam`` when ``zero_optimization.offload_optimizer`` is on cpu or
nvme, and torch's own class with ``torch_adam: true``; the check holds for what ``initialize`` returns and for
``engine.optimizer.optimizer``, whichever Adam zero steps with. A plain torch optimizer is neither.
"""

import pytest
import torch

import zero
from zero.as_deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam


@pytest.mark.parametrize(
    ("kind", "stage", "offload", "params", "want"),
    [
        ("Adam", 0, None, {}, FusedAdam),
        ("AdamW", 2, None, {}, FusedAdam),
        ("adam", 3, None, {}, FusedAdam),
        ("Adam", 2, "cpu", {}, DeepSpeedCPUAdam),
        ("AdamW", 3, "cpu", {}, DeepSpeedCPUAdam),
        ("Adam", 1, None, {"torch_adam": True}, torch.optim.AdamW),
        ("SGD", 0, None, {}, torch.optim.SGD),
    ],
)
def test_the_config_optimizer_is_an_instance_of_the_class_deepspeed_builds(kind, stage, offload, params, want):
    net = torch.nn.Linear(4, 4)
    zero_optimization = {"stage": stage, **({"offload_optimizer": {"device": offload}} if offload else {})}
    config = {"train_batch_size": 2, "optimizer": {"type": kind, "params": {"lr": 1e-3, **params}},
              "zero_optimization": zero_optimization}  # fmt: skip
    engine, optimizer, _, _ = zero.initialize(model=net, model_parameters=net.parameters(), config=config)
    for opt in (optimizer, engine.optimizer.optimizer):
        assert isinstance(opt, want), (kind, stage, offload, type(opt))
        others = {FusedAdam, DeepSpeedCPUAdam} - {want}
        assert not any(isinstance(opt, cls) for cls in others), (kind, stage, offload, type(opt))
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()  # it still steps


def test_a_torch_optimizer_is_not_taken_for_deepspeeds_adam():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    assert not isinstance(opt, FusedAdam) and not isinstance(opt, DeepSpeedCPUAdam)
    assert isinstance(FusedAdam([torch.nn.Parameter(torch.ones(2))]), FusedAdam)
