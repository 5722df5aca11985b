"""Optional ahead-of-time build of the CPU ops: ``ZERO_BUILD_OPS=1 pip install ./packages/zero-kernels``.

Without ZERO_BUILD_OPS=1 the package is pure Python (metadata lives in pyproject.toml) and ops are built just in
time on first use. With it, cpu_adam is compiled here into ``zero_kernels._op_cpu_adam`` with pybind11 alone (its
sources include no torch header, so torch is not needed at build time); the loader uses it when its embedded
source hash matches the installed sources. CUDA ops are always built just in time (they need torch's CUDA headers).
Mirrors DeepSpeed's DS_BUILD_OPS=1.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("ZERO_BUILD_OPS", "0") == "1":
    try:
        from pybind11.setup_helpers import Pybind11Extension, build_ext
    except ImportError:
        sys.exit("ZERO_BUILD_OPS=1 needs pybind11 in the build environment (it is in build-system.requires)")
    here = Path(__file__).resolve().parent
    # Load the op table by path: importing the package would import torch.
    spec = importlib.util.spec_from_file_location("_zero_kernels_ops", here / "src" / "zero_kernels" / "ops.py")
    ops = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ops  # dataclasses resolve the module while the file runs
    spec.loader.exec_module(ops)
    op = ops.OPS["cpu_adam"]
    ext_modules.append(
        Pybind11Extension(
            "zero_kernels._op_cpu_adam",
            sources=[os.path.relpath(op.path(s), here) for s in op.sources],
            include_dirs=[str(ops.CSRC)],
            define_macros=[("TORCH_EXTENSION_NAME", "_op_cpu_adam"), ("ZERO_OP_SOURCE_HASH", op.source_hash())],
            extra_compile_args=list(op.cflags),
            extra_link_args=list(op.ldflags),
            cxx_std=17,
        )
    )
    cmdclass["build_ext"] = build_ext

setup(ext_modules=ext_modules, cmdclass=cmdclass)
