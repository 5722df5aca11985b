"""Blockwise symmetric quantization (ZeRO++, arXiv 2306.10209 section 3) with a pluggable kernel registry.

``x`` (flattened, zero-padded to a multiple of ``block``) is cut into blocks; each block gets one fp32 scale
``absmax / qmax`` with ``qmax = 2**(bits-1) - 1`` (127 for int8, 7 for int4), and ``q = round(x / scale)``.
Hence ``|dequantize(q) - x| <= scale / 2`` for every element. int8 values are stored as ``int8``; int4 values are
stored offset by 8 (0..15) and packed two per byte (element 2i in the low nibble, 2i+1 in the high nibble).

Default block size: 4096 elements, after DeepSpeed's ``CUDAQuantizer`` (ZeRO++'s qwZ), whose comment says the
optimal group size is about 4k and which targets groups below 8000 elements.

Registry: :func:`register_quantizer` maps a name to a (quantize, dequantize) pair with the signatures of
:func:`torch_quantize` / :func:`torch_dequantize`; zero_kernels can register CUDA kernels there without zero_comm
importing it. ``"torch"`` (pure torch, this file) is always present and is the reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

DEFAULT_BLOCK = 4096
SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedTensor:
    """A blockwise-quantized flat tensor.

    Attributes:
        data: uint8 (int4, packed, ``padded_numel / 2`` bytes) or int8 (``padded_numel`` bytes), 1-D.
        scales: fp32, one per block (``padded_numel / block``).
        numel: elements of the original tensor (before padding).
        bits: 4 or 8.
        block: elements per block.
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes of data plus scales: what a quantized collective sends for this tensor."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def check_params(bits: int, block: int) -> None:
    """Raise ValueError unless ``bits`` is 4 or 8 and ``block`` is a positive int (even for int4)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or (bits == 4 and block % 2):
        raise ValueError(f"block must be a positive int (even for int4), got {block!r}")


def padded_numel(numel: int, block: int) -> int:
    """``numel`` rounded up to a whole number of blocks (at least one block)."""
    return max(1, math.ceil(numel / block)) * block


def payload_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of data plus fp32 scales for ``numel`` elements quantized with ``bits`` and ``block``."""
    p = padded_numel(numel, block)
    return p * bits // 8 + (p // block) * 4


def torch_quantize(x: torch.Tensor, bits: int, block: int) -> QuantizedTensor:
    """Pure-torch blockwise symmetric quantization of ``x`` (any float dtype; computed in fp32).

    Raises:
        ValueError: bits not 4/8, bad block, or ``x`` not floating point.
    """
    check_params(bits, block)
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point to quantize, got {x.dtype}")
    numel = x.numel()
    p = padded_numel(numel, block)
    flat = torch.zeros(p, dtype=torch.float32, device=x.device)
    flat[:numel] = x.reshape(-1)
    blocks = flat.view(-1, block)
    qmax = 2 ** (bits - 1) - 1
    absmax = blocks.abs().amax(dim=1)
    # a tensor divisor: CUDA torch turns division by a Python number into a reciprocal multiply (not IEEE)
    scales = absmax / torch.full_like(absmax, qmax)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block quantizes to zeros
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)
    if bits == 4:
        u = (q + 8).to(torch.uint8).view(-1, 2)
        q = u[:, 0] | (u[:, 1] << 4)
    return QuantizedTensor(q, scales, numel, bits, block)


def torch_dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`torch_quantize`: a flat tensor of ``qt.numel`` elements in ``dtype``."""
    if qt.bits == 4:
        lo = (qt.data & 0x0F).to(torch.int8) - 8
        hi = (qt.data >> 4).to(torch.int8) - 8
        q = torch.stack([lo, hi], dim=1).view(-1)
    else:
        q = qt.data
    values = q.view(-1, qt.block).to(torch.float32) * qt.scales[:, None]
    return values.view(-1)[: qt.numel].to(dtype)


@dataclass(frozen=True)
class Quantizer:
    """A named pair of kernels: ``quantize(x, bits, block) -> QuantizedTensor``, ``dequantize(qt, dtype) -> x``."""

    name: str
    quantize: Callable[[torch.Tensor, int, int], QuantizedTensor]
    dequantize: Callable[[QuantizedTensor, torch.dtype], torch.Tensor]


_REGISTRY: dict[str, Quantizer] = {"torch": Quantizer("torch", torch_quantize, torch_dequantize)}


def register_quantizer(name: str, quantize: Callable, dequantize: Callable, *, replace: bool = False) -> None:
    """Make kernels available as ``quantizer=name`` in the quantized collectives.

    They must match :func:`torch_quantize` / :func:`torch_dequantize` exactly in layout (data packing, one fp32
    scale per block) so ranks using different kernels interoperate.

    Raises:
        ValueError: ``name`` is already registered and ``replace`` is False, or is "torch".
    """
    if name == "torch" or (name in _REGISTRY and not replace):
        raise ValueError(f"quantizer {name!r} is already registered (pass replace=True to override; 'torch' is fixed)")
    _REGISTRY[name] = Quantizer(name, quantize, dequantize)


def get_quantizer(name: str = "torch") -> Quantizer:
    """The registered quantizer ``name``. Raises ValueError naming the registered ones when unknown."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown quantizer {name!r}; registered: {sorted(_REGISTRY)}") from None


def quantize_blockwise(
    x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK, *, quantizer: str = "torch"
) -> QuantizedTensor:
    """Quantize ``x`` blockwise and symmetrically to ``bits`` (4 or 8) with one fp32 scale per ``block`` elements.

    Guarantee: every element of ``dequantize_blockwise(result)`` is within ``scale / 2`` of ``x`` (its block's
    scale). See the module docstring for the layout and the default block size's source.
    """
    return get_quantizer(quantizer).quantize(x, bits, block)


def dequantize_blockwise(
    qt: QuantizedTensor, dtype: torch.dtype = torch.float32, *, quantizer: str = "torch"
) -> torch.Tensor:
    """Dequantize ``qt`` into a flat tensor of ``qt.numel`` elements in ``dtype``."""
    return get_quantizer(quantizer).dequantize(qt, dtype)
