"""zero.optim.muon alone (no runtime) against the update rule written out here, and the `optimizer` section of
type Muon: DeepSpeed 0.19.8's keys, its rule for which parameters use Muon, and named errors."""

import math

import pytest
import torch

from zero.config import ConfigError, load_config
from zero.optim import build_optimizer
from zero.optim.muon import Muon, newton_schulz, orthogonalised


def _ns_ref(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz from the rule, float64, on the wide orientation."""
    u = u.double()
    tall = u.shape[-2] > u.shape[-1]
    x = u.mT if tall else u
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        a = x @ x.mT
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.mT if tall else x


@pytest.mark.parametrize("shape", [(32, 16), (8, 32), (10, 10), (3, 6, 20), (7, 1)])
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_newton_schulz_matches_the_rule(shape, method):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(u, method=method)
    torch.testing.assert_close(got.double(), _ns_ref(u), rtol=0, atol=2e-5)
    s = torch.linalg.svdvals(got.double())
    assert s.max() < 1.25 and s.min() > 0.6, f"singular values {s}: not roughly orthogonal"


def test_scale_and_conv_filters_follow_deepspeed():
    tall = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(orthogonalised(tall).double(), _ns_ref(tall) * 2.0, rtol=0, atol=4e-5)
    conv = torch.randn(6, 3, 5, 2, generator=torch.Generator().manual_seed(3))  # viewed as (6, 30); scale 5/2
    want = _ns_ref(conv.reshape(6, -1)).reshape(conv.shape) * math.sqrt(5 / 2)
    torch.testing.assert_close(orthogonalised(conv).double(), want, rtol=0, atol=5e-5)


def _ref_steps(w0, b0, grads, lr, beta, wd, adam_lr, betas, eps, adam_w_mode):
    w, b = w0.double().clone(), b0.double().clone()
    m = torch.zeros_like(w)
    ma, va = torch.zeros_like(b), torch.zeros_like(b)
    for t, (gw, gb) in enumerate(grads, start=1):
        gw, gb = gw.double(), gb.double()
        m = beta * m + (1 - beta) * gw
        o = _ns_ref((1 - beta) * gw + beta * m) * math.sqrt(max(1, w.shape[0] / w.shape[1]))
        w = w * (1 - lr * wd) - lr * o
        if not adam_w_mode:
            gb = gb + wd * b
        ma = betas[0] * ma + (1 - betas[0]) * gb
        va = betas[1] * va + (1 - betas[1]) * gb * gb
        upd = (ma / (1 - betas[0] ** t)) / ((va / (1 - betas[1] ** t)).sqrt() + eps)
        b = (b * (1 - adam_lr * wd) if adam_w_mode else b) - adam_lr * upd
    return w.float(), b.float()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_standalone_steps_match_the_rule(adam_w_mode):
    gen = torch.Generator().manual_seed(4)
    w0, b0 = torch.randn(12, 5, generator=gen), torch.randn(12, generator=gen)
    grads = [(torch.randn(12, 5, generator=gen), torch.randn(12, generator=gen)) for _ in range(4)]
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    opt = Muon([{"params": [w], "use_muon": True, "lr": 0.05, "momentum": 0.9, "weight_decay": 0.1},
                {"params": [b], "use_muon": False, "lr": 1e-2, "weight_decay": 0.1}],
               adam_w_mode=adam_w_mode)  # fmt: skip
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
    want_w, want_b = _ref_steps(w0, b0, grads, 0.05, 0.9, 0.1, 1e-2, (0.9, 0.95), 1e-10, adam_w_mode)
    torch.testing.assert_close(w.detach(), want_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.detach(), want_b, rtol=1e-5, atol=1e-6)


def test_a_non_finite_gradient_leaves_the_momentum_alone():
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = Muon([{"params": [w], "use_muon": True}])
    w.grad = torch.ones(4, 3)
    opt.step()
    before = opt.state[w]["momentum_buffer"].clone()
    opt.blend(w, torch.full((4, 3), float("inf")), opt.param_groups[0])
    assert torch.equal(opt.state[w]["momentum_buffer"], before)


def test_a_flat_muon_parameter_alone_is_a_named_error():
    p = torch.nn.Parameter(torch.randn(6))
    opt = Muon([{"params": [p], "use_muon": True}])
    p.grad = torch.ones(6)
    with pytest.raises(ValueError, match="whole matrix"):
        opt.step()
    with pytest.raises(ValueError, match="use_muon"):
        Muon([{"params": [p]}])
    with pytest.raises(ValueError, match="ns_method"):
        Muon([{"params": [p], "use_muon": True, "ns_method": "svd"}])


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 4)
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.proj = torch.nn.Linear(4, 4)
        self.lm_head = torch.nn.Linear(4, 11, bias=False)


def _section(params: dict):
    return load_config({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": params}}, 1).optimizer


def test_which_parameters_use_muon_and_their_settings():
    net = _Net()
    params = {"lr": 1e-3, "muon_lr": 0.03, "adam_lr": 2e-4, "momentum": 0.9, "weight_decay": 0.01,
              "betas": [0.8, 0.9], "eps": 1e-9, "ns_method": "standard"}  # fmt: skip
    opt = build_optimizer(_section(params), net.parameters(), net)
    names = {id(p): n for n, p in net.named_parameters()}
    by = {g["use_muon"]: g for g in opt.param_groups}
    assert sorted(names[id(p)] for p in by[True]["params"]) == ["conv.weight", "proj.weight"]
    assert sorted(names[id(p)] for p in by[False]["params"]) == ["conv.bias", "embed_tokens.weight",
                                                                 "lm_head.weight", "proj.bias"]  # fmt: skip
    assert (by[True]["lr"], by[True]["momentum"], by[True]["weight_decay"], by[True]["ns_method"]) == (
        0.03, 0.9, 0.01, "standard")  # fmt: skip
    assert (by[False]["lr"], tuple(by[False]["betas"]), by[False]["eps"]) == (2e-4, (0.8, 0.9), 1e-9)


def test_group_settings_win_and_defaults_are_deepspeeds():
    net = _Net()
    groups = [{"params": [net.proj.weight, net.proj.bias], "weight_decay": 0.0, "lr": 0.5},
              {"params": [p for n, p in net.named_parameters() if not n.startswith("proj")]}]  # fmt: skip
    opt = build_optimizer(_section({"weight_decay": 0.1}), groups, net)
    got = [(g["use_muon"], g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    assert got == [(True, 0.5, 0.0, 1), (False, 0.5, 0.0, 1), (True, 0.02, 0.1, 1), (False, 3e-4, 0.1, 3)]
    adam = opt.param_groups[3]
    assert (tuple(adam["betas"]), adam["eps"], opt.param_groups[2]["momentum"]) == ((0.9, 0.95), 1e-10, 0.95)


def test_config_errors_name_the_key():
    for bad, key in (({"ns_method": "svd"}, "ns_method"), ({"per_head_muon": True}, "per_head_muon"),
                     ({"momentum": 1.0}, "momentum"), ({"nesterov": False}, "nesterov")):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            _section(bad).typed_params()
    with pytest.raises(ValueError, match="needs the model"):
        build_optimizer(_section({}), _Net().parameters())
    outsider = torch.nn.Parameter(torch.randn(3, 3))
    with pytest.raises(ValueError, match=r"shape \(3, 3\) is not one of the model's"):
        build_optimizer(_section({}), [outsider], _Net())


def test_save_muon_momentum_buffer_in_memory_is_accepted():
    cfg = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3,
                       "save_muon_momentum_buffer_in_memory": True}}, 1)  # fmt: skip
    assert cfg.zero_optimization.save_muon_momentum_buffer_in_memory is True
