"""``zero report``: the environment (like DeepSpeed's ``ds_report``): torch, CUDA, zero packages, ops."""

from __future__ import annotations

import importlib.metadata as md
import platform
import shutil

PACKAGES = [
    "zero",
    "zero-comm",
    "zero-kernels",
    "zero-profiler",
    "zero-core",
    "zero-parallel",
    "zero-inference",
    "zero-offload",
    "zero-compile",
]


def add_arguments(parser) -> None:
    """No options."""


def _ops() -> list[tuple[str, str]]:
    """(op, status) per zero_kernels op without building anything: prebuilt, cached, buildable or why not."""
    try:
        from zero_kernels import loader
    except ImportError as e:
        return [("zero_kernels", f"not importable: {e}")]
    rows = []
    for name, spec in loader.OPS.items():
        try:
            digest = spec.source_hash()
        except OSError as e:
            rows.append((name, f"sources incomplete: {e}"))
            continue
        if loader._prebuilt(spec, digest) is not None:
            rows.append((name, "prebuilt"))
        elif (loader.cache_root() / f"{name}-{digest}").is_dir():
            rows.append((name, f"built (cache {loader.cache_root()})"))
        else:
            try:
                loader._check_toolchain(spec)
                rows.append((name, "buildable just in time (first use compiles it)"))
            except loader.BuildError as e:
                rows.append((name, f"not buildable: {e}"))
    return rows


def lines() -> list[str]:
    """The report as text lines."""
    import torch

    out = [f"python          {platform.python_version()} ({platform.machine()})"]
    out.append(f"torch           {torch.__version__}")
    cuda = torch.version.cuda or "none (CPU build)"
    out.append(f"torch CUDA      {cuda}; available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        out += [f"  GPU {i}         {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    dist = torch.distributed
    out.append(f"distributed     gloo: {dist.is_gloo_available()}, nccl: {dist.is_nccl_available()}")
    out.append(f"compiler        c++: {shutil.which('c++') or 'missing'}; ninja: {shutil.which('ninja') or 'missing'}")
    out.append("packages")
    for p in PACKAGES:
        try:
            out.append(f"  {p + ' ':<14}{md.version(p)}")
        except md.PackageNotFoundError:
            out.append(f"  {p + ' ':<14}not installed")
    out.append("ops (zero_kernels)")
    out += [f"  {name:<14}{status}" for name, status in _ops()]
    out += _offload()
    return out


def _offload() -> list[str]:
    try:
        from zero_offload.availability import offload_paths
    except ImportError as e:
        return [f"offload         zero_offload not importable: {e}"]
    return ["offload (zero_offload)"] + [f"  {name:<24}{status}" for name, status in offload_paths()]


def run(args) -> int:
    """Print the report; exit code 0."""
    print("\n".join(lines()))
    return 0
