"""DeepCompile-style torch.compile passes for ZeRO-3 and ZeRO-1 over zero_core's layout and zero_comm's collectives.

``CompiledZero`` compiles a model so its forward and backward graphs gather, release and reduce-scatter ZeRO units
as graph operations (``zero_compile.ops``); passes (``zero_compile.passes``) are composed by a schedule keyed by
optimizer step and refined by a profile-guided loop (``zero_compile.profile``). ``SequenceParallelBackend`` compiles
a model with the autosp pass instead: Ulysses sequence parallelism around every ``scaled_dot_product_attention``;
``TensorParallelBackend`` with the autotp pass: an AutoTP-split model's tensor-parallel collectives in the graph;
``CpuAttentionBackend`` with the cpu_attention pass: bf16/fp16 attention on CPU in fp32 where that is faster.
"""

from importlib.metadata import version as _version

from zero_compile import ops  # noqa: F401  (registers the graph operations)
from zero_compile.compiled import WARMUP, CompiledZero
from zero_compile.cpu_backend import CpuAttentionBackend
from zero_compile.layout import CompiledLayout, ShardSource
from zero_compile.passes import PREFETCH, SELECTIVE_UNSHARD, ZERO1, ZERO3, Pass, PassContext, PassError, run_passes
from zero_compile.profile import Plan, ProfilingInterpreter, make_plan
from zero_compile.sp_backend import SequenceParallelBackend, compile_sequence_parallel
from zero_compile.store import UnitStore
from zero_compile.tp_backend import TensorParallelBackend, compile_tensor_parallel

__version__ = _version("zero-compile")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "PREFETCH",
    "SELECTIVE_UNSHARD",
    "WARMUP",
    "ZERO1",
    "ZERO3",
    "CompiledLayout",
    "CompiledZero",
    "CpuAttentionBackend",
    "Pass",
    "PassContext",
    "PassError",
    "Plan",
    "ProfilingInterpreter",
    "SequenceParallelBackend",
    "ShardSource",
    "TensorParallelBackend",
    "UnitStore",
    "compile_sequence_parallel",
    "compile_tensor_parallel",
    "make_plan",
    "run_passes",
]
