"""Connect zero_kernels' ops to the layers that can use them. Only the meta-package may: zero_comm and zero_kernels
import no other zero package (tests-integration/test_layering.py).

ZeRO++'s quantized collectives (zero_comm.zeropp) look up their quantize/dequantize pair by name in zero_comm's
registry; ``"torch"`` is the pure-torch reference. :func:`register_quantizer_kernels` registers zero_kernels'
blockwise quantizer (a CUDA kernel on CUDA tensors, torch's reference elsewhere) as ``"zero_kernels"``. Both use
one layout (one fp32 scale ``absmax/qmax`` per block, round half to even, int4 as ``q+8`` two per byte), and
tests-integration/test_quantize_registry.py checks the two torch paths are bit-identical, so ranks may mix them.
"""

from __future__ import annotations

import torch

QUANTIZER_NAME = "zero_kernels"


def _quantize(x: torch.Tensor, bits: int, block: int):
    """zero_comm's ``quantize(x, bits, block) -> QuantizedTensor`` over ``zero_kernels.quantize_blockwise``."""
    import zero_kernels
    from zero_comm.quantize import QuantizedTensor, check_params

    check_params(bits, block)
    data, scales = zero_kernels.quantize_blockwise(x, bits, block)
    return QuantizedTensor(data, scales, x.numel(), bits, block)


def _dequantize(qt, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """zero_comm's ``dequantize(qt, dtype) -> flat tensor`` over ``zero_kernels.dequantize_blockwise``."""
    import zero_kernels

    return zero_kernels.dequantize_blockwise(qt.data, qt.scales, qt.numel, qt.bits, qt.block).to(dtype)


def register_quantizer_kernels(*, require_cuda: bool = True) -> str | None:
    """Register zero_kernels' quantizer in zero_comm's registry as ``"zero_kernels"`` (replacing an earlier one).

    With ``require_cuda`` (as ``zero.initialize`` calls it) this happens only when CUDA is available and the
    ``cuda_ops`` op loads (it is built just in time on first use; a failed build is reported once by zero_kernels
    and nothing is registered). Without it the pair is registered anyway; on CPU tensors it runs zero_kernels'
    torch reference.

    Returns:
        the registered name, or None when nothing was registered.
    """
    if require_cuda:
        if not torch.cuda.is_available():
            return None
        import zero_kernels

        if not zero_kernels.available("cuda_ops"):
            return None
    from zero_comm import register_quantizer

    register_quantizer(QUANTIZER_NAME, _quantize, _dequantize, replace=True)
    return QUANTIZER_NAME
