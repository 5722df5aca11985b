"""Exact MAC/FLOP counts per op family, against hand-derived math (2 FLOPs per MAC; bias 1 FLOP per output)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_profiler import FlopsProfiler


class _Call(nn.Module):
    """Runs an arbitrary function as a module forward so its ops count as the model's."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _forward(fn, *args):
    model = fn if isinstance(fn, nn.Module) else _Call(fn)
    with FlopsProfiler(model) as prof:
        model(*args)
    return prof.profile.forward


def test_linear_with_bias_counts_one_flop_per_output_element():
    lin = nn.Linear(8, 16)
    with FlopsProfiler(lin) as prof:
        lin(torch.randn(4, 8))
    fwd = prof.profile.forward
    assert fwd.macs == 4 * 16 * 8 == 512
    assert fwd.flops == 2 * 512 + 4 * 16


def test_addmm_and_linear_apply_the_same_bias_convention():
    x, w, b = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16)
    via_addmm = _forward(lambda: torch.addmm(b, x, w.t()))
    via_linear = _forward(lambda: F.linear(x, w, b))
    assert (via_addmm.macs, via_addmm.flops) == (via_linear.macs, via_linear.flops) == (512, 1088)
    # linear on a non-contiguous 3-D input runs matmul + add; the bias still costs one FLOP per output element.
    x3 = torch.randn(3, 2, 8).transpose(0, 1)
    strided = _forward(lambda: F.linear(x3, w, b))
    assert (strided.macs, strided.flops) == (2 * 3 * 16 * 8, 2 * 768 + 2 * 3 * 16)
    no_bias = _forward(lambda: F.linear(x, w))
    assert (no_bias.macs, no_bias.flops) == (512, 1024)


@pytest.mark.parametrize(
    "a_shape, b_shape, macs",
    [
        ((8,), (8,), 8),  # dot
        ((2, 1, 4, 8), (3, 8, 5), 2 * 3 * 4 * 5 * 8),  # broadcast batch, 960
        ((5, 8), (8,), 5 * 8),  # matrix @ vector
        ((8,), (8, 5), 8 * 5),  # vector @ matrix
        ((4, 8), (8, 5), 4 * 5 * 8),
        ((3, 4, 8), (3, 8, 5), 3 * 4 * 5 * 8),
        ((2, 4, 8), (8,), 2 * 4 * 8),  # batched @ vector
        ((7, 4, 8), (8, 5), 7 * 4 * 5 * 8),  # batched @ matrix (folded into one mm)
    ],
)
def test_matmul_in_all_shapes_counts_output_elements_times_contracted_dim(a_shape, b_shape, macs):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    fwd = _forward(torch.matmul, a, b)
    assert fwd.macs == macs
    assert fwd.flops == 2 * macs
    assert fwd.by_category == {"matmul": 2 * macs}


def test_bmm_baddbmm_addmv_addbmm():
    b1, b2 = torch.randn(3, 4, 8), torch.randn(3, 8, 5)
    assert _forward(torch.bmm, b1, b2).macs == 480
    fwd = _forward(torch.baddbmm, torch.randn(3, 4, 5), b1, b2)
    assert (fwd.macs, fwd.flops) == (480, 960 + 60)
    fwd = _forward(torch.addbmm, torch.randn(4, 5), b1, b2)
    assert (fwd.macs, fwd.flops) == (480, 960 + 20)
    fwd = _forward(torch.addmv, torch.randn(5), torch.randn(5, 8), torch.randn(8))
    assert (fwd.macs, fwd.flops) == (40, 80 + 5)
    # beta=0 ignores the additive input: no bias FLOPs.
    fwd = _forward(lambda: torch.addmm(torch.randn(4, 16), torch.randn(4, 8), torch.randn(8, 16), beta=0))
    assert (fwd.macs, fwd.flops) == (512, 1024)


@pytest.mark.parametrize(
    "conv, x_shape, macs",
    [
        # normal: output elements x (C_in / groups) x kernel elements
        (nn.Conv1d(3, 4, 3), (2, 3, 10), 2 * 4 * 8 * 3 * 3),
        (nn.Conv2d(3, 4, 3, stride=2, padding=1), (1, 3, 8, 8), 4 * 4 * 4 * 3 * 9),
        (nn.Conv2d(4, 6, 3, groups=2), (1, 4, 5, 5), 6 * 3 * 3 * 2 * 9),
        (nn.Conv3d(2, 3, 2), (1, 2, 4, 4, 4), 3 * 27 * 2 * 8),
        # transposed: input elements x (C_out / groups) x kernel elements
        (nn.ConvTranspose1d(3, 4, 3), (1, 3, 8), 3 * 8 * 4 * 3),
        (nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2), (2, 4, 5, 5), 2 * 4 * 25 * 3 * 9),
    ],
)
def test_convolutions_forward_and_backward(conv, x_shape, macs):
    x = torch.randn(x_shape, requires_grad=True)
    with FlopsProfiler(conv) as prof:
        out = conv(x)
        out.sum().backward()
    p = prof.profile
    assert p.forward.macs == macs
    assert p.forward.flops == 2 * macs + out.numel()  # bias: one FLOP per output element
    # backward: input gradient + weight gradient (one forward's MACs each), bias gradient = one reduction.
    assert p.backward.macs == 2 * macs
    assert p.backward.by_category["conv"] == 4 * macs + out.numel()


def test_conv_without_bias_and_without_input_grad():
    conv = nn.Conv2d(3, 4, 3, bias=False)
    with FlopsProfiler(conv) as prof:
        conv(torch.randn(1, 3, 6, 6)).sum().backward()
    macs = 4 * 16 * 27
    assert (prof.profile.forward.macs, prof.profile.forward.flops) == (macs, 2 * macs)
    assert prof.profile.backward.macs == macs  # only the weight gradient is needed


def test_scaled_dot_product_attention_fused_forward_two_matmuls_backward_four():
    b, h, l_q, l_k, e = 2, 3, 5, 7, 4
    q, k, v = (torch.randn(b, h, n, e, requires_grad=True) for n in (l_q, l_k, l_k))
    model = _Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    with FlopsProfiler(model) as prof:
        model(q, k, v).sum().backward()
    fwd_macs = b * h * l_q * l_k * (e + e)
    assert prof.profile.forward.macs == fwd_macs
    assert prof.profile.forward.by_category == {"attention": 2 * fwd_macs}
    assert prof.profile.backward.macs == 2 * fwd_macs
    assert prof.profile.backward.by_category["attention"] == 4 * fwd_macs


def test_scaled_dot_product_attention_math_path_counts_the_same_matmuls():
    # A value head dim unlike the query's takes PyTorch's math path: bmm + scale + softmax, counted by their rules.
    b, h, l_q, l_k, e, e_v = 2, 3, 5, 7, 4, 6
    q, k = torch.randn(b, h, l_q, e, requires_grad=True), torch.randn(b, h, l_k, e, requires_grad=True)
    v = torch.randn(b, h, l_k, e_v, requires_grad=True)
    model = _Call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    with FlopsProfiler(model) as prof:
        model(q, k, v).sum().backward()
    fwd_macs = b * h * l_q * l_k * (e + e_v)
    fwd = prof.profile.forward
    assert fwd.macs == fwd_macs
    assert fwd.by_category["matmul"] == 2 * fwd_macs
    assert fwd.by_category["norm"] == 4 * b * h * l_q * l_k  # softmax over the scores
    assert fwd.by_category["pointwise"] == q.numel() + k.numel()  # q and k each scaled by sqrt(scale)
    assert prof.profile.backward.macs == 2 * fwd_macs


def test_linear_backward_counts_two_matmuls_and_the_bias_gradient():
    lin = nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with FlopsProfiler(lin) as prof:
        lin(x).sum().backward()
    p = prof.profile
    assert p.backward.macs == 2 * 512
    assert p.backward.flops == 2 * 1024 + 4 * 16  # grad_input, grad_weight, bias reduction
    assert p.outside.flops == 64  # the caller's .sum() ran outside the model


def test_normalization_softmax_pointwise_conventions():
    x = torch.randn(4, 32)
    assert _forward(nn.LayerNorm(32), x).flops == 128 * 7  # 5 + weight + bias
    assert _forward(nn.LayerNorm(32, elementwise_affine=False), x).flops == 128 * 5
    assert _forward(lambda t: torch.softmax(t, -1), x).flops == 128 * 4
    assert _forward(lambda t: t * 2 + 1, x).flops == 2 * 128
    assert _forward(lambda t: t.clone().masked_fill(t > 0, 0.0), x).flops == 0  # data movement, a comparison
    assert _forward(lambda t: torch.arange(10).sum(), x).flops == 0  # integer work is not floating point
    bn = nn.BatchNorm1d(32)
    assert _forward(bn, x).flops == 128 * 7
    assert _forward(bn.eval(), x).flops == 128 * 4
