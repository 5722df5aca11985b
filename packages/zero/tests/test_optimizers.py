"""Config-built optimizers follow DeepSpeed's semantics (Adam defaults to decoupled decay) and torch's numerics."""

import pytest
import torch

from zero.config import ConfigError, load_config
from zero.optim import build_optimizer


def _run(opt_cfg: dict, ref_cls, ref_kwargs: dict, steps: int = 5):
    torch.manual_seed(0)
    init = [torch.randn(7), torch.randn(4097)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = build_optimizer(load_config({"train_batch_size": 1, "optimizer": opt_cfg}, 1).optimizer, ours)
    ref_opt = ref_cls(ref, **ref_kwargs)
    for s in range(steps):
        for p, q in zip(ours, ref):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(s))
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    return opt


@pytest.mark.parametrize("torch_adam", [True, False])
def test_adam_type_defaults_to_adamw_mode(torch_adam):
    params = {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": torch_adam}
    _run({"type": "Adam", "params": params}, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def test_adam_with_adam_w_mode_false_is_l2_adam():
    params = {"lr": 1e-2, "weight_decay": 0.1, "adam_w_mode": False}
    _run({"type": "Adam", "params": params}, torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1})


def test_adamw_and_sgd():
    _run({"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.95]}}, torch.optim.AdamW,
         {"lr": 3e-3, "betas": (0.8, 0.95), "weight_decay": 0.0})  # fmt: skip
    _run({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def test_adamw_with_adam_w_mode_false_is_an_error():
    with pytest.raises(ConfigError, match="adam_w_mode"):
        load_config({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, 1)
