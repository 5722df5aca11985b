"""Subchannel quantized Linear (zero_kernels.subchannel_linear) against a reference written here from the rule.

The reference quantizes block by block in Python loops (scale = block amax / qmax, qmax 448 for e4m3 and 127 for
int8; FP8 value = clamp(x / scale) cast to e4m3; INT8 value = clamp(round(x / scale)); dequantized = value *
scale) and multiplies the dequantized fp32 operands; on CPU the layer's forward output and all three gradients equal
it bit for bit. Against the unquantized Linear the error of every GEMM output element is within the bound that
follows from the rule (see ``_elementwise_bound``).
"""

import pytest
import torch

from zero_kernels import (
    GemmQuant,
    LinearQuantRecipe,
    SubchannelLinear,
    dequantize_subchannel,
    quantize_subchannel,
    quantized_matmul,
    subchannel_linear,
)

QMAX = {"fp8": 448.0, "int8": 127.0}


def _ref_fake_quantize(t: torch.Tensor, dim: int, fmt: str, block_size: int) -> torch.Tensor:
    """The rule, one block at a time: t's fp32 dequantized values, quantized along ``dim``."""
    m = t.float() if dim == 1 else t.float().t()
    out = torch.empty_like(m)
    length = m.shape[1]
    block = length if block_size == 0 or block_size >= length else block_size
    qmax = QMAX[fmt]
    for r in range(m.shape[0]):
        for start in range(0, length, block):
            blk = m[r, start : start + block]
            scale = blk.abs().max() / qmax
            y = blk / scale if scale > 0 else blk
            if fmt == "fp8":
                q = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).float()
            else:
                q = torch.round(y).clamp(-qmax, qmax)
            out[r, start : start + block] = q * scale
    return (out if dim == 1 else out.t()).contiguous()


def _ref_gemm(a, b, spec):
    if spec is None:
        return torch.matmul(a, b.to(a.dtype)).float()
    return torch.matmul(_ref_fake_quantize(a, 1, spec.fmt, spec.block_size),
                        _ref_fake_quantize(b, 0, spec.fmt, spec.block_size))  # fmt: skip


def _reference_linear(x, weight, bias, dy, recipe):
    """Forward output and (dx, dW, db) of the quantized Linear, from the rule."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    y = _ref_gemm(x2, weight.t(), recipe.forward) + bias.float()
    dx = _ref_gemm(dy2, weight, recipe.dx).to(x.dtype).view(x.shape)
    dw = _ref_gemm(dy2.t(), x2, recipe.dw).to(weight.dtype)
    return y.to(x.dtype).view(dy.shape), dx, dw, dy2.float().sum(0).to(bias.dtype)


def _run_layer(x, linear, dy, recipe):
    layer = SubchannelLinear(linear, recipe)
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, linear.weight.grad, linear.bias.grad


def _problem(tokens=(2, 5), fin=50, fout=24, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(fin, fout).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(fout, fin, generator=g))
        linear.bias.copy_(torch.randn(fout, generator=g))
    x = torch.randn(*tokens, fin, generator=g).to(dtype)
    dy = torch.randn(*tokens, fout, generator=g).to(dtype)
    return x, linear, dy


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("block_size", [0, 16, 32, 64])  # 50/24/10 long dimensions: whole, partial and single blocks
def test_quantize_matches_the_rule_per_block(fmt, block_size):
    t = torch.randn(7, 50, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 50)
    t[2] = 0.0  # an all-zero row: scale 0, values 0
    for dim in (0, 1):
        q, scales = quantize_subchannel(t, dim, fmt, block_size)
        length = t.shape[dim]
        blocks = 1 if block_size in (0,) or block_size >= length else -(-length // block_size)
        assert q.shape == t.shape and q.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[fmt]
        assert scales.dtype == torch.float32
        assert scales.shape == ((7, blocks) if dim == 1 else (blocks, 50))
        got = dequantize_subchannel(q, scales, dim, block_size)
        assert torch.equal(got, _ref_fake_quantize(t, dim, fmt, block_size))
        assert q.float().abs().max() <= QMAX[fmt]
    assert torch.equal(quantize_subchannel(t, 1, fmt, block_size)[1][2], torch.zeros_like(scales[0]))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("block_size", [0, 16, 128])  # 128 exceeds every reduction dimension: one block
def test_layer_equals_the_reference_exactly(fmt, block_size):
    x, linear, dy = _problem()
    spec = GemmQuant(fmt, block_size)
    recipe = LinearQuantRecipe(spec, spec, spec)
    got = _run_layer(x, linear, dy, recipe)
    want = _reference_linear(x, linear.weight.detach(), linear.bias.detach(), dy, recipe)
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(g, w), name


def test_each_gemm_configured_on_its_own():
    x, linear, dy = _problem(tokens=(3, 7), fin=40, fout=33, seed=3)
    recipe = LinearQuantRecipe(forward=GemmQuant("int8", 16), dx=None, dw=GemmQuant("fp8", 0))
    got = _run_layer(x, linear, dy, recipe)
    want = _reference_linear(x, linear.weight.detach(), linear.bias.detach(), dy, recipe)
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(g, w), name
    # dx left unquantized is F.linear's own input gradient
    xr = x.detach().requires_grad_()
    torch.nn.functional.linear(xr, linear.weight.detach(), linear.bias.detach()).backward(dy)
    assert torch.allclose(got[1], xr.grad, rtol=1e-6, atol=1e-5)


def _elementwise_bound(t: torch.Tensor, dim: int, fmt: str, block_size: int) -> torch.Tensor:
    """|t - dequantized(t)| allowed by the rule, per element. FP8 e4m3 (3 mantissa bits, smallest normal 2^-6,
    subnormal spacing 2^-9, in units of the block's scale): half a unit in the last place, 2^-4 of |x| for a
    normal value, 2^-10 x scale below; INT8: half a step, scale / 2."""
    _, scales = quantize_subchannel(t, dim, fmt, block_size)
    scale = dequantize_subchannel(torch.ones_like(t).to(torch.int8), scales, dim, block_size)
    if fmt == "fp8":
        return t.abs() * 2.0**-4 + scale * 2.0**-10
    return scale / 2


@pytest.mark.parametrize("fmt,typical", [("fp8", 0.06), ("int8", 0.015)])
@pytest.mark.parametrize("block_size", [0, 16])
def test_error_against_unquantized_linear_is_within_the_rule(fmt, typical, block_size):
    """Each GEMM's output differs from the unquantized product by at most |A| E_B + E_A |B| + E_A E_B (E: the
    operands' element bounds above), plus fp32 rounding; the relative Frobenius error of every output on
    Gaussian data stays under ``typical`` (6% for FP8 e4m3, 1.5% for INT8)."""
    x, linear, dy = _problem(tokens=(4, 16), fin=96, fout=48, seed=5)
    spec = GemmQuant(fmt, block_size)
    got = _run_layer(x, linear, dy, LinearQuantRecipe(spec, spec, spec))
    w = linear.weight.detach()
    x2, dy2 = x.reshape(-1, 96), dy.reshape(-1, 48)
    for out, a, b in ((got[0].reshape(-1, 48) - linear.bias.detach(), x2, w.t()), (got[1].reshape(-1, 96), dy2, w),
                      (got[2], dy2.t(), x2)):  # fmt: skip
        exact = a @ b
        ea, eb = _elementwise_bound(a, 1, fmt, block_size), _elementwise_bound(b, 0, fmt, block_size)
        bound = a.abs() @ eb + ea @ b.abs() + ea @ eb
        slack = 1e-5 * (a.abs() @ b.abs()) + 1e-6  # fp32 accumulation and the bias round trip
        assert ((out - exact).abs() <= bound + slack).all()
        assert ((out - exact).norm() / exact.norm()).item() < typical


def test_bf16_layer_keeps_dtypes_and_matches_the_reference():
    x, linear, dy = _problem(dtype=torch.bfloat16, seed=7)
    spec = GemmQuant("fp8", 16)
    recipe = LinearQuantRecipe(spec, spec, spec)
    got = _run_layer(x, linear, dy, recipe)
    want = _reference_linear(x, linear.weight.detach(), linear.bias.detach(), dy, recipe)
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w), name


def test_autocast_output_dtype_and_fp32_gemm_inside():
    x, linear, dy = _problem(seed=9)
    recipe = LinearQuantRecipe(GemmQuant("int8", 0), None, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = subchannel_linear(x, linear.weight, linear.bias, recipe)
    assert y.dtype == torch.bfloat16
    want = (_ref_gemm(x.reshape(-1, 50), linear.weight.detach().t(), recipe.forward) + linear.bias.detach()).to(
        torch.bfloat16
    )
    assert torch.equal(y.detach().reshape(-1, 24), want)


def test_non_finite_values_reach_the_output():
    """A block holding inf or NaN gets a non-finite scale: a loss scaler sees the overflow in the gradients."""
    x, linear, dy = _problem(seed=11)
    dy[0, 1, 3] = float("inf")
    for fmt in ("fp8", "int8"):
        spec = GemmQuant(fmt, 16)
        linear.weight.grad = linear.bias.grad = None
        _, dx, dw, _ = _run_layer(x, linear, dy, LinearQuantRecipe(spec, spec, spec))
        assert not torch.isfinite(dx).all() and not torch.isfinite(dw).all()
    t = torch.ones(2, 20)
    t[1, 5] = float("nan")
    q, scales = quantize_subchannel(t, 1, "int8", 8)
    assert torch.isnan(dequantize_subchannel(q, scales, 1, 8)[1, :8]).all()
    assert torch.isfinite(dequantize_subchannel(q, scales, 1, 8)[1, 8:]).all()


def test_scaled_mm_path_matches_the_emulation():
    """``torch._scaled_mm`` (the FP8 row-scaling GEMM the GPU path uses) runs on CPU too when asked for: it equals
    the emulation up to fp32 summation order; blockwise and INT8 GEMMs are emulated whatever the backend."""
    g = torch.Generator().manual_seed(13)
    a, b = torch.randn(24, 80, generator=g), torch.randn(80, 40, generator=g)
    row = GemmQuant("fp8", 0)
    scaled, emulated = quantized_matmul(a, b, row, "scaled_mm"), quantized_matmul(a, b, row, "emulate")
    assert torch.allclose(scaled, emulated, rtol=1e-5, atol=1e-5)
    assert torch.equal(quantized_matmul(a, b, row, "auto"), emulated)  # auto on CPU: emulation
    for spec in (GemmQuant("fp8", 16), GemmQuant("int8", 0)):
        assert torch.equal(quantized_matmul(a, b, spec, "scaled_mm"), quantized_matmul(a, b, spec, "emulate"))
    x, linear, dy = _problem(tokens=(4, 8), fin=64, fout=32, seed=15)
    via = _run_layer(x, linear, dy, LinearQuantRecipe(row, row, row, backend="scaled_mm"))
    linear.weight.grad = linear.bias.grad = None
    emul = _run_layer(x, linear, dy, LinearQuantRecipe(row, row, row, backend="emulate"))
    for v, e in zip(via, emul):
        assert torch.allclose(v, e, rtol=1e-5, atol=1e-4)


def test_module_keeps_parameters_keys_mode_and_hooks():
    linear = torch.nn.Linear(8, 4)
    linear.eval()
    seen = []
    linear.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    layer = SubchannelLinear(linear, LinearQuantRecipe())
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert list(layer.state_dict()) == list(linear.state_dict()) and not layer.training
    assert isinstance(layer, torch.nn.Linear)
    layer(torch.randn(3, 8))
    assert seen == [torch.Size([3, 4])]
    no_bias = SubchannelLinear(torch.nn.Linear(8, 4, bias=False), LinearQuantRecipe())
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]
    out = no_bias(torch.randn(0, 8, requires_grad=True))  # no tokens: empty output, zero weight gradient
    out.sum().backward()
    assert out.shape == (0, 4) and torch.equal(no_bias.weight.grad, torch.zeros(4, 8))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="format"):
        GemmQuant("fp4", 128)
    with pytest.raises(ValueError, match="block_size"):
        GemmQuant("fp8", -1)
    with pytest.raises(ValueError, match="backend"):
        LinearQuantRecipe(backend="cublas")
    with pytest.raises(ValueError, match="2-D"):
        quantize_subchannel(torch.ones(2, 3, 4), 1, "fp8", 0)
