"""Blockwise symmetric int8/int4 quantization in zero_comm's layout: the CUDA op on CUDA tensors, torch elsewhere.

Layout (identical to ``zero_comm.quantize``, so kernels can be registered there by a higher layer): ``x`` is
flattened and zero-padded to a whole number of ``block``-element blocks (at least one); each block has one fp32 scale
``absmax / qmax`` (``qmax`` 127 for int8, 7 for int4) and ``q = round(x / scale)`` (half to even) clamped to
``[-qmax, qmax]``; an all-zero block has scale 0 and zeros. int8 data is ``int8[padded]``; int4 data is
``uint8[padded / 2]`` holding ``q + 8``, element 2i in the low nibble and 2i+1 in the high nibble.
Mirrors ZeRO++ (arXiv 2306.10209, section 3.1, blockwise quantization for qwZ/qgZ).
"""

from __future__ import annotations

import torch

from zero_kernels import loader


def _check(bits: int, block: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or (bits == 4 and block % 2):
        raise ValueError(f"block must be a positive int (even for int4), got {block!r}")


def quantize_blockwise_reference(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch quantization; returns ``(data, scales)`` in the layout of the module docstring."""
    _check(bits, block)
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point to quantize, got {x.dtype}")
    numel = x.numel()
    padded = max(1, -(-numel // block)) * block
    flat = torch.zeros(padded, dtype=torch.float32, device=x.device)
    flat[:numel] = x.reshape(-1)
    blocks = flat.view(-1, block)
    qmax = 2 ** (bits - 1) - 1
    absmax = blocks.abs().amax(dim=1)
    # a tensor divisor: CUDA torch turns division by a Python number into a reciprocal multiply (not IEEE)
    scales = absmax / torch.full_like(absmax, qmax)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)
    if bits == 4:
        u = (q + 8).to(torch.uint8).view(-1, 2)
        q = u[:, 0] | (u[:, 1] << 4)
    return q, scales


def dequantize_blockwise_reference(
    data: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, block: int
) -> torch.Tensor:
    """Pure-torch inverse of :func:`quantize_blockwise_reference`: flat fp32 tensor of ``numel`` elements."""
    _check(bits, block)
    if bits == 4:
        lo = (data & 0x0F).to(torch.int8) - 8
        hi = (data >> 4).to(torch.int8) - 8
        q = torch.stack([lo, hi], dim=1).view(-1)
    else:
        q = data
    return (q.view(-1, block).to(torch.float32) * scales[:, None]).view(-1)[:numel]


def _cuda_op():
    return loader.resolved("cuda_ops")


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (any float dtype and shape) to ``(data, scales)``; CUDA kernel for CUDA tensors if it builds.

    Raises:
        ValueError: bits not 4/8, block not a positive int (even for int4), or ``x`` not floating point.
    """
    _check(bits, block)
    if x.is_cuda and (op := _cuda_op()) is not None:
        data, scales = op.quantize(x, bits, block)
        return data, scales
    return quantize_blockwise_reference(x, bits, block)


def dequantize_blockwise(
    data: torch.Tensor, scales: torch.Tensor, numel: int, bits: int = 8, block: int = 4096
) -> torch.Tensor:
    """Dequantize ``(data, scales)`` to a flat fp32 tensor of ``numel`` elements (CUDA kernel on CUDA tensors)."""
    _check(bits, block)
    if data.is_cuda and (op := _cuda_op()) is not None:
        return op.dequantize(data, scales, numel, bits, block)
    return dequantize_blockwise_reference(data, scales, numel, bits, block)
