"""DeepSpeed's op builders (served as ``deepspeed.ops.op_builder``), answered from what zero serves.

A script probes ``CPUAdamBuilder().is_compatible()`` (or ``deepspeed.ops.__compatible_ops__``) before choosing a
path, and may ``load()`` the op. Here an op is compatible when zero serves it on this machine: CPU Adam
(``zero_kernels``' C++ op, or its torch fallback), fused Adam (the CUDA op, or torch's fused/foreach AdamW) and
async I/O (the ``aio`` op, or a thread pool of ``pread``/``pwrite``). ``load()`` returns ``zero_kernels``' compiled
module where there is one (building it on first use, as DeepSpeed's JIT path). Every other DeepSpeed builder is
DeepSpeed's ``NotImplementedBuilder``: not compatible, and ``load()`` raises ``NotSupportedError``.
"""

from __future__ import annotations

import torch

from zero.config import NotSupportedError


class OpBuilder:
    """One op: ``NAME`` (DeepSpeed's op name), ``KERNEL`` (``zero_kernels``' op behind it, or None)."""

    NAME = "deepspeed_not_implemented"
    KERNEL: str | None = None

    def __init__(self):
        self.name = self.NAME

    def absolute_name(self) -> str:
        """DeepSpeed's module name of the op's extension."""
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when zero serves this op here (with its torch fallback where the compiled op cannot be built)."""
        return True

    def load(self, verbose: bool = True):
        """The compiled extension module (``zero_kernels.load``), built on first use.

        Raises:
            NotSupportedError: zero has no compiled module for this op here (its torch path is used instead).
            zero_kernels.BuildError: the build failed (the message names the compiler error).
        """
        if self.KERNEL is None:
            raise NotSupportedError(f"{type(self).__name__}.load(): zero has no compiled {self.NAME!r} op here; "
                                    "its optimizer uses the torch path")  # fmt: skip
        import zero_kernels

        return zero_kernels.load(self.KERNEL)


class CPUAdamBuilder(OpBuilder):
    """DeepSpeed's ``cpu_adam``: ``zero_kernels``' CPU Adam."""

    NAME = "cpu_adam"
    KERNEL = "cpu_adam"


class FusedAdamBuilder(OpBuilder):
    """DeepSpeed's ``fused_adam``: the CUDA op on GPU machines, torch's AdamW on the CPU."""

    NAME = "fused_adam"
    KERNEL = "cuda_ops" if torch.cuda.is_available() else None


class AsyncIOBuilder(OpBuilder):
    """DeepSpeed's ``async_io`` (NVMe offload's I/O engine): ``zero_kernels``' ``aio``."""

    NAME = "async_io"
    KERNEL = "aio"


class NotImplementedBuilder(OpBuilder):
    """An op zero does not serve: not compatible; ``load()`` raises ``NotSupportedError``."""

    NAME = "deepspeed_not_implemented"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Never compatible."""
        return False

    def load(self, verbose: bool = True):
        """Raises NotSupportedError."""
        raise NotSupportedError(
            "this DeepSpeed op is not implemented by zero (its op builder is NotImplementedBuilder)"
        )


_SERVED = {cls.__name__: cls for cls in (CPUAdamBuilder, FusedAdamBuilder, AsyncIOBuilder)}
_NOT_SERVED = ("CPUAdagradBuilder", "CPULionBuilder", "FusedLambBuilder", "FusedLionBuilder", "QuantizerBuilder",
               "FPQuantizerBuilder", "TransformerBuilder", "InferenceBuilder", "SparseAttnBuilder", "GDSBuilder",
               "EvoformerAttnBuilder", "RaggedOpsBuilder", "RandomLTDBuilder", "CCLCommBuilder",
               "ShareMemCommBuilder", "PinMemoryBuilder", "UtilsBuilder")  # fmt: skip


def builder_class(class_name: str) -> type[OpBuilder]:
    """The builder class named ``class_name``; ``NotImplementedBuilder`` for any other name (DeepSpeed's answer)."""
    return _SERVED.get(class_name, NotImplementedBuilder)


CPUAdagradBuilder = CPULionBuilder = FusedLambBuilder = FusedLionBuilder = NotImplementedBuilder
QuantizerBuilder = FPQuantizerBuilder = TransformerBuilder = InferenceBuilder = NotImplementedBuilder
SparseAttnBuilder = GDSBuilder = EvoformerAttnBuilder = RaggedOpsBuilder = NotImplementedBuilder
RandomLTDBuilder = CCLCommBuilder = ShareMemCommBuilder = PinMemoryBuilder = UtilsBuilder = NotImplementedBuilder

ALL_OPS = {"cpu_adam": True, "fused_adam": True, "async_io": True, "cpu_adagrad": False, "cpu_lion": False,
           "fused_lamb": False, "fused_lion": False, "quantizer": False, "fp_quantizer": False,
           "transformer": False, "transformer_inference": False, "sparse_attn": False, "gds": False,
           "evoformer_attn": False, "ragged_device_ops": False, "random_ltd": False, "deepspeed_ccl_comm": False,
           "deepspeed_shm_comm": False, "pin_memory": False, "deepspeed_not_implemented": False}  # fmt: skip
"""DeepSpeed op name -> whether zero serves it here."""
COMPATIBLE_OPS = dict(ALL_OPS)
"""``deepspeed.ops.__compatible_ops__``: a copy of :data:`ALL_OPS`, one dict, so a script's edits to it persist (as
DeepSpeed's)."""

__all__ = ["ALL_OPS", "COMPATIBLE_OPS", "AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder",
           "NotImplementedBuilder", "OpBuilder", "builder_class", *_NOT_SERVED]  # fmt: skip
