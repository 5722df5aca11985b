"""Blockwise quantization: error bound, int4 packing, padding, registry."""

import pytest
import torch

from zero_comm import dequantize_blockwise, get_quantizer, quantize_blockwise, register_quantizer
from zero_comm.quantize import _REGISTRY, payload_bytes, torch_dequantize, torch_quantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel,block", [(1000, 64), (4096, 4096), (77, 16), (5, 8)])
def test_error_within_half_scale(bits, numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    qt = quantize_blockwise(x, bits, block)
    y = dequantize_blockwise(qt)
    assert y.shape == (numel,)
    per_elem_scale = qt.scales.repeat_interleave(block)[:numel]
    assert torch.all((y - x).abs() <= per_elem_scale / 2 * (1 + 1e-6) + 1e-12)
    assert qt.data.numel() == -(-numel // block) * block * bits // 8
    assert qt.nbytes == payload_bytes(numel, bits, block)
    # scales are absmax / qmax of each block
    padded = torch.nn.functional.pad(x, (0, qt.scales.numel() * block - numel)).view(-1, block)
    torch.testing.assert_close(qt.scales, padded.abs().amax(1) / (2 ** (bits - 1) - 1))


def test_int4_packs_two_values_per_byte_low_nibble_first():
    x = torch.tensor([7.0, -7.0, 0.0, 1.0])
    qt = quantize_blockwise(x, 4, 4)  # scale 1.0: q = x
    assert qt.data.dtype == torch.uint8 and qt.data.tolist() == [(7 + 8) | ((-7 + 8) << 4), 8 | (9 << 4)]
    assert torch.equal(dequantize_blockwise(qt), x)


def test_zero_block_and_bf16_roundtrip():
    x = torch.zeros(10, dtype=torch.bfloat16)
    qt = quantize_blockwise(x, 8, 4)
    assert torch.equal(dequantize_blockwise(qt, torch.bfloat16), x)
    assert qt.scales.tolist() == [0.0, 0.0, 0.0]


def test_bad_parameters_raise():
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_blockwise(torch.ones(4), 3, 4)
    with pytest.raises(ValueError, match="block must be a positive int"):
        quantize_blockwise(torch.ones(4), 4, 3)
    with pytest.raises(ValueError, match="floating point"):
        quantize_blockwise(torch.ones(4, dtype=torch.int32), 8, 4)
    with pytest.raises(ValueError, match="unknown quantizer 'cuda'"):
        quantize_blockwise(torch.ones(4), 8, 4, quantizer="cuda")


def test_registry_dispatches_to_registered_kernels():
    calls = []

    def q(x, bits, block):
        calls.append("q")
        return torch_quantize(x, bits, block)

    def dq(qt, dtype):
        calls.append("dq")
        return torch_dequantize(qt, dtype)

    register_quantizer("counting", q, dq)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_quantizer("counting", q, dq)
        y = dequantize_blockwise(quantize_blockwise(torch.ones(8), 8, 4, quantizer="counting"), quantizer="counting")
        assert calls == ["q", "dq"] and torch.equal(y, torch.ones(8))
        assert get_quantizer("counting").name == "counting"
    finally:
        _REGISTRY.pop("counting")
