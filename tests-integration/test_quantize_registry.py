"""zero_kernels' blockwise quantizer and zero_comm's registry, connected by the meta-package (zero.kernels).

The swap is safe only if zero_kernels' torch reference (what its CUDA kernel is tested against) and zero_comm's
torch quantizer produce the same bytes: checked bit for bit on int8 and int4, odd sizes (padding), zero blocks,
bf16 inputs and halfway values (round half to even). Then the registration itself: get_quantizer returns the
registered pair, which round-trips through zero_comm's API and its quantized all-gather on 2 ranks.
"""

import pytest
import torch

import zero_kernels
from zero.kernels import QUANTIZER_NAME, register_quantizer_kernels
from zero_comm import QuantizedAllGather, dequantize_blockwise, get_quantizer, quantize_blockwise
from zero_comm.quantize import torch_dequantize, torch_quantize
from zero_comm.testing import run_ranks
from zero_kernels.quantize import dequantize_blockwise_reference, quantize_blockwise_reference


def _inputs():
    g = torch.Generator().manual_seed(7)
    yield "randn 1000", torch.randn(1000, generator=g)
    yield "randn 3x333 (padded)", torch.randn(3, 333, generator=g) * 1e-3
    yield "zero block", torch.cat([torch.zeros(64), torch.randn(37, generator=g)])
    yield "bf16", torch.randn(513, generator=g).bfloat16()
    yield "halfway", torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 3.5, -3.5] * 9)  # scale 1 at int8 -> ties


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [64, 4096])
def test_kernels_reference_and_comm_quantizer_are_bit_identical(bits, block):
    for what, x in _inputs():
        data, scales = quantize_blockwise_reference(x, bits, block)
        qt = torch_quantize(x, bits, block)
        assert data.dtype == qt.data.dtype and torch.equal(data, qt.data), what
        assert torch.equal(scales, qt.scales), what
        ours = dequantize_blockwise_reference(data, scales, x.numel(), bits, block)
        assert torch.equal(ours, torch_dequantize(qt, torch.float32)), what
        # the public entry points on CPU tensors take the same path
        pub = zero_kernels.quantize_blockwise(x, bits, block)
        assert torch.equal(pub[0], qt.data) and torch.equal(pub[1], qt.scales), what


def test_registered_quantizer_is_returned_and_round_trips():
    name = register_quantizer_kernels(require_cuda=False)
    assert name == QUANTIZER_NAME
    q = get_quantizer(name)
    assert q.name == name and q.quantize.__module__ == "zero.kernels"
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    for bits in (8, 4):
        ours = quantize_blockwise(x, bits, 128, quantizer=name)
        ref = torch_quantize(x, bits, 128)
        assert (ours.numel, ours.bits, ours.block) == (1001, bits, 128)
        assert torch.equal(ours.data, ref.data) and torch.equal(ours.scales, ref.scales)
        back = dequantize_blockwise(ours, torch.bfloat16, quantizer=name)
        assert back.dtype == torch.bfloat16 and torch.equal(back, torch_dequantize(ref, torch.bfloat16))
        assert (back.float() - x).abs().max() <= ref.scales.max() / 2 + 1e-2  # bf16 rounding on top of scale/2


def test_initialize_registers_only_with_cuda():
    cuda = torch.cuda.is_available() and zero_kernels.available("cuda_ops")
    assert register_quantizer_kernels() == (QUANTIZER_NAME if cuda else None)


def gather_body(name: str) -> tuple:
    from zero.kernels import register_quantizer_kernels

    register_quantizer_kernels(require_cuda=False)  # each rank registers in its own process
    rank = torch.distributed.get_rank()
    x = torch.randn(300, generator=torch.Generator().manual_seed(rank))
    out = {}
    for q in ("torch", name):
        buf = torch.empty(600)
        QuantizedAllGather(torch.distributed.group.WORLD, bits=8, block=64, quantizer=q)(buf, x)
        out[q] = buf
    return out["torch"], out[name]


def test_registered_quantizer_in_quantized_all_gather():
    for ref, ours in run_ranks(gather_body, 2, QUANTIZER_NAME, timeout=60):
        assert torch.equal(ref, ours)
