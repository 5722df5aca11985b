"""memory_report: exact bytes by category for plain torch objects, caller-given categories, RSS, errors."""

import pytest
import torch
from torch import nn

from zero_profiler import CATEGORIES, memory_report, rss_bytes


def _tiny_net() -> nn.Module:
    torch.manual_seed(1234)
    net = nn.Sequential(nn.Linear(8, 13), nn.GELU(), nn.Linear(13, 7), nn.BatchNorm1d(7))
    return net


def test_plain_torch_model_and_adamw_are_counted_exactly():
    net = _tiny_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    params = 8 * 13 + 13 + 13 * 7 + 7 + 7 + 7  # 229 fp32
    r = memory_report(net, opt)
    assert r.parameters == params * 4
    assert r.gradients == 0 and r.optimizer_state == 0
    assert r.buffers == (7 + 7) * 4 + 8  # running mean/var fp32 + num_batches_tracked int64
    net(torch.randn(5, 8)).sum().backward()
    opt.step()
    r = memory_report(net, opt)
    assert r.gradients == params * 4
    # exp_avg and exp_avg_sq per parameter (fp32) plus one scalar fp32 'step' per parameter tensor.
    assert r.optimizer_state == 2 * params * 4 + 6 * 4
    assert r.master_weights == 0
    assert r.model_states == r.parameters + r.gradients + r.optimizer_state + r.buffers
    assert set(r.sources.values()) == {"introspected"}


def test_optimizer_params_not_in_the_model_are_master_weights():
    net = _tiny_net().to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in net.parameters()]
    opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    r = memory_report(net, opt)
    numel = sum(p.numel() for p in net.parameters())
    assert r.parameters == numel * 2
    assert r.master_weights == numel * 4


def test_known_categories_override_introspection_and_are_validated():
    net = _tiny_net()
    r = memory_report(net, known={"parameters": 1000, "optimizer_state": 24})
    assert (r.parameters, r.optimizer_state) == (1000, 24)
    assert r.sources["parameters"] == "given" and r.sources["buffers"] == "introspected"
    assert r.master_weights == 0
    with pytest.raises(ValueError, match=r"known\['params'\]: unknown category"):
        memory_report(net, known={"params": 1})
    with pytest.raises(ValueError, match=r"known\['gradients'\] = -1: expected a non-negative int"):
        memory_report(net, known={"gradients": -1})
    assert CATEGORIES == ("parameters", "gradients", "master_weights", "optimizer_state", "buffers")


def test_peak_rss_grows_with_a_large_allocation_and_format_reads():
    peak0, now0 = rss_bytes()
    assert peak0 > 0 and now0 > 0 and peak0 >= now0
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    peak1, now1 = rss_bytes()
    assert now1 - now0 > 48 * 2**20
    assert peak1 >= now1
    del big
    r = memory_report()
    assert r.peak_rss >= peak1 and r.model_states == 0
    text = r.format()
    assert text.startswith("memory: parameters 0.00 MiB") and "peak RSS" in text
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        assert r.gpu_allocated is None and "GPU" not in text
