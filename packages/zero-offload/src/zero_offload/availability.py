"""Which offload paths this machine offers (for ``zero report``), found without building anything."""

from __future__ import annotations

import os
import tempfile

import torch


def offload_paths(folder: str | None = None) -> list[tuple[str, str]]:
    """(path, status) pairs: host optimizer offload, pinned memory, SuperOffload's worker, NVMe offload (O_DIRECT
    probed in ``folder``, default the temporary directory), parameter offload.

    Never raises; never compiles (the ops' build status is in the report's ops section).
    """
    rows = [("offload_optimizer cpu", "available (fp32 masters + CPU Adam in host memory)")]
    pinned = "available" if torch.cuda.is_available() else "no accelerator: pin_memory falls back to pageable memory"
    rows.append(("pin_memory", pinned))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    rows.append(("super_offload", f"available ({cores} cores; the worker uses cpuadam_cores_perc of them)"))
    folder = folder or tempfile.gettempdir()
    try:
        from zero_kernels.aio import supports_direct

        direct = "O_DIRECT" if supports_direct(folder) else "no O_DIRECT (page cache fallback)"
        rows.append(("offload_optimizer nvme", f"available; {folder}: {direct}"))
    except Exception as e:  # a report lists problems, it does not stop at them
        rows.append(("offload_optimizer nvme", f"unavailable: {e}"))
    rows.append(("offload_param cpu", "available (stage 3: parameter shards in host memory between uses)"))
    rows.append(("offload_param nvme", "available (stage 3: one swap file per unit through the aio engine)"))
    return rows
