"""Subchannel quantization of a GEMM operand: 8-bit values with one fp32 scale per block of its reduction dimension.

The rule (what ``zero_kernels.subchannel_linear`` applies to each operand of the forward, input-gradient and
weight-gradient GEMMs of a Linear layer, as DeepSpeed's subchannel quantized training describes it):

* An operand is a 2-D matrix reduced along ``dim`` (1 for the left operand ``A`` of ``A @ B``, 0 for the right
  operand ``B``). Along that dimension, each row (``dim`` 1) or column (``dim`` 0) is cut into blocks of
  ``block_size`` elements starting at index 0; the last block is shorter when the length is not a multiple.
  ``block_size`` 0 (or one at least the length) is row scaling: one block spans the whole reduction dimension.
* Each block gets the fp32 scale ``amax / qmax``, with ``amax`` the block's largest absolute value (computed in
  fp32 from the operand's own dtype) and ``qmax`` the format's largest value: 448 for FP8 e4m3 (``torch.float8_e4m3fn``:
  the block's largest element lands on e4m3's largest finite value) and 127 for INT8 (symmetric, -128 unused).
* FP8: ``q = clamp(x / scale, -448, 448)`` cast to e4m3 (round to nearest even; the clamp keeps a quotient rounded
  just above 448 finite). INT8: ``q = clamp(round(x / scale), -127, 127)`` (round half to even).
* An all-zero block has scale 0 and zero values (its quotient is taken with divisor 1). A block holding inf or
  NaN has a non-finite scale, so its dequantized values are non-finite and a loss scaler sees the overflow.
* Dequantized value: ``q * scale`` in fp32.

The division is an IEEE tensor division (CUDA turns division by a Python number into a reciprocal multiply),
so the rule gives the same bits on every device.
"""

from __future__ import annotations

import torch

FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "fp8": (torch.float8_e4m3fn, 448.0),  # e4m3's largest finite value
    "int8": (torch.int8, 127.0),  # symmetric: -128 is never produced
}


def check_format(fmt: str, block_size: int) -> None:
    """ValueError unless ``fmt`` is "fp8"/"int8" and ``block_size`` a non-negative int (0: row scaling)."""
    if fmt not in FORMATS:
        raise ValueError(f"quantization format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise ValueError(f"block_size must be a non-negative int (0: row scaling), got {block_size!r}")


def block_length(length: int, block_size: int) -> int:
    """Elements per block along a reduction dimension of ``length`` (the whole dimension for row scaling)."""
    return length if block_size == 0 or block_size >= length else block_size


def _blocks(t: torch.Tensor, dim: int, fmt: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The rule on ``t`` cut into blocks along ``dim``, no transpose: ``q`` is (rows, blocks, block) for ``dim`` 1
    and (blocks, block, cols) for ``dim`` 0, ``scales`` (rows, blocks) / (blocks, cols); returns ``(q, scales,
    length)``. A short last block is zero-padded (zeros change no block's amax)."""
    check_format(fmt, block_size)
    if t.dim() != 2 or not t.is_floating_point() or dim not in (0, 1):
        raise ValueError(f"expected a 2-D floating-point operand and dim 0 or 1, got shape {tuple(t.shape)}, "
                         f"{t.dtype}, dim {dim!r}")  # fmt: skip
    t32 = t.float()
    length, other = t32.shape[dim], t32.shape[1 - dim]
    block = block_length(length, block_size)
    blocks = -(-length // block) if length else 0
    pad = blocks * block - length
    if dim == 1:
        padded = torch.nn.functional.pad(t32, (0, pad)) if pad else t32
        padded, within = padded.reshape(other, blocks, block), 2
    else:
        padded = torch.nn.functional.pad(t32, (0, 0, 0, pad)) if pad else t32
        padded, within = padded.reshape(blocks, block, other), 1
    dtype, qmax = FORMATS[fmt]
    amax = padded.abs().amax(dim=within) if block else padded.new_zeros(padded.shape[0], padded.shape[2])
    scales = amax / torch.full_like(amax, qmax)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # NaN scales too: they carry the NaN
    y = padded / divisor.unsqueeze(within)
    if fmt == "fp8":
        q = y.clamp_(-qmax, qmax).to(dtype)
    else:  # the scale carries a NaN; the integer cast of NaN is undefined, so the value becomes 0
        q = torch.round(y).clamp_(-qmax, qmax).nan_to_num_(0.0).to(dtype)
    return q, scales, length


def _unblock(blocked: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    if dim == 1:
        return blocked.reshape(blocked.shape[0], blocked.shape[1] * blocked.shape[2])[:, :length]
    return blocked.reshape(blocked.shape[0] * blocked.shape[1], blocked.shape[2])[:length]


def quantize_subchannel(t: torch.Tensor, dim: int, fmt: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the 2-D ``t`` along ``dim`` by the module docstring's rule.

    Returns ``(q, scales)``: ``q`` has ``t``'s shape in the format's dtype (float8_e4m3fn or int8); ``scales`` are
    fp32, one per block: shape ``(rows, blocks)`` for ``dim`` 1, ``(blocks, cols)`` for ``dim`` 0.

    Raises:
        ValueError: ``t`` not 2-D floating point, ``dim`` not 0/1, or a bad format / block size.
    """
    q, scales, length = _blocks(t, dim, fmt, block_size)
    return _unblock(q, length, dim), scales


def dequantize_subchannel(q: torch.Tensor, scales: torch.Tensor, dim: int, block_size: int) -> torch.Tensor:
    """fp32 ``q * scale`` of :func:`quantize_subchannel`'s output (same ``dim`` and ``block_size``), contiguous."""
    length = q.shape[dim]
    block = block_length(length, block_size)
    full = scales.repeat_interleave(block, dim=dim).narrow(dim, 0, length) if length else scales
    return (q.float() * full).contiguous()


def fake_quantize(t: torch.Tensor, dim: int, fmt: str, block_size: int) -> torch.Tensor:
    """``t`` quantized and dequantized (fp32, contiguous): what the emulated GEMM multiplies; equal to
    :func:`dequantize_subchannel` of :func:`quantize_subchannel`, computed in the blocked layout."""
    q, scales, length = _blocks(t, dim, fmt, block_size)
    return _unblock(q.float().mul_(scales.unsqueeze(2 if dim == 1 else 1)), length, dim).contiguous()
