"""The ops this package can build: sources, flags and the source hash that names each build.

Standard library only, so that ``setup.py`` can load this file by path at install time (``ZERO_BUILD_OPS=1``)
without torch.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"


@dataclass(frozen=True)
class OpSpec:
    """How to build one op.

    Attributes:
        name: op name, as given to :func:`load`.
        sources: C++/CUDA sources, relative to ``zero_kernels/csrc`` or absolute.
        headers: files the sources include; hashed, not compiled.
        cflags: extra C++ compiler flags. ``cuda_cflags``: extra nvcc flags.
        ldflags: extra linker flags.
        cuda: the op needs CUDA (nvcc and a CUDA-enabled torch).
    """

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()
    cflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda: bool = False
    prebuilt_module: str = field(default="")

    def path(self, rel: str) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else CSRC / p

    def source_hash(self) -> str:
        """sha256 (16 hex digits) of the sources, headers, flags and Python ABI: what decides a rebuild."""
        h = hashlib.sha256()
        h.update(repr((self.name, self.cflags, self.cuda_cflags, self.ldflags, self.cuda)).encode())
        h.update((sysconfig.get_config_var("EXT_SUFFIX") or "").encode())
        for rel in self.sources + self.headers:
            h.update(Path(rel).name.encode() + b"\0" + self.path(rel).read_bytes() + b"\0")
        return h.hexdigest()[:16]


# No FMA contraction: each operation rounds as in torch's kernels, so results match torch to the last bit or so.
_CPU_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-Wall")
OPS: dict[str, OpSpec] = {
    "cpu_adam": OpSpec(
        name="cpu_adam",
        sources=(
            "cpu_adam/binding.cpp",
            "cpu_adam/adam_avx512.cpp",
            "cpu_adam/adam_avx2.cpp",
            "cpu_adam/adam_generic.cpp",
        ),
        headers=("cpu_adam/adam_kernel.h", "cpu_adam/adam_args.h"),
        cflags=_CPU_FLAGS,
        ldflags=("-fopenmp",),
    ),
    "aio": OpSpec(
        name="aio",
        sources=("aio/aio.cpp",),
        cflags=("-O2", "-std=c++17", "-Wall", "-pthread"),
        ldflags=("-pthread",),
    ),
    "cuda_ops": OpSpec(
        name="cuda_ops",
        sources=("cuda/binding.cpp", "cuda/fused_adam.cu", "cuda/quantize.cu"),
        headers=("cuda/kernels.h",),
        cflags=("-O3", "-std=c++17"),
        cuda_cflags=("-O3", "-std=c++17", "--use_fast_math"),
        cuda=True,
    ),
}
