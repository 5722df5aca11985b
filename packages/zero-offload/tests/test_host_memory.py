"""``return_freed_memory`` (what NVMe parameter offload sets at start): activation-sized tensors (0.3 MiB, above
the 128 KiB threshold) get their own mappings, returned to the OS when freed, instead of heap blocks; glibc's
default, which raises its threshold after the first large free, serves them from the heap. Checked with glibc's own
counters (``mallinfo2``) in a fresh interpreter, so this test's process keeps its allocator settings."""

import json
import subprocess
import sys

import torch

SCRIPT = r"""
import ctypes, json, sys
import torch
from zero_offload.host_memory import return_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "set":
    assert return_freed_memory()
elif sys.argv[1] in ("optimizer", "param"):  # what the engine builds for offload to NVMe
    from zero_core import ZeroConfig
    from zero_kernels.aio import AioSettings
    from zero_offload import master_store_for, param_store_for

    model = torch.nn.Linear(64, 64)
    section = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[2]}}
    if sys.argv[1] == "param":
        section["offload_param"] = {"device": "nvme", "nvme_path": sys.argv[2]}
    cfg = ZeroConfig.model_validate(section)
    master_store_for(cfg, model, 1, 0, AioSettings(block_size=4096))
    param_store_for(cfg, model, 1, 0, AioSettings(block_size=4096))
big = torch.empty(8 << 20, dtype=torch.uint8)  # 8 MiB: served by mmap either way; its free raises glibc's default
del big
before = libc.mallinfo2()
held = [torch.ones(80_000) for _ in range(64)]  # 64 x 0.3 MiB, like a short micro-batch's activations
during = libc.mallinfo2()
del held
after = libc.mallinfo2()
from zero_comm.buffers import scratch
print(json.dumps({"mapped_during": during.hblkhd - before.hblkhd, "heap_free_after": after.fordblks,
                  "heap_during": during.arena - before.arena, "scratch_idle_limit": scratch.max_idle_bytes}))
"""


def _run(mode: str, folder: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, folder], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_activations_leave_the_heap():
    tensor = 80_000 * 4
    fixed, default = _run("set"), _run("default")
    # with the threshold fixed, the 0.3 MiB tensors get their own mappings (unmapped when freed); a few are carved
    # from free chunks already in the heap, which are reused before anything is mapped (how many depends on what
    # the imports freed: 1-5 of 64 seen), and the heap does not grow
    assert fixed["mapped_during"] >= 48 * tensor and fixed["heap_during"] < 2 * tensor, fixed
    # glibc's default (threshold raised by the 8 MiB free) serves them all from the heap, where freed blocks stay
    # unless they happen to sit at its top (some come from free chunks the imports left, as above)
    assert default["mapped_during"] < tensor and default["heap_during"] >= 48 * tensor, default


def test_nvme_offload_keeps_no_idle_scratch_buffer():
    from zero_comm.buffers import DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY, scratch
    from zero_offload.host_memory import keep_no_idle_scratch

    try:
        scratch.max_idle_bytes, scratch.per_key = DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY
        buf = scratch.take(1 << 16, torch.float32)
        scratch.give(buf)
        assert scratch.idle_bytes == buf.numel() * 4  # by default the pool keeps it for reuse
        keep_no_idle_scratch()
        assert scratch.idle_bytes == 0
        scratch.give(scratch.take(1 << 16, torch.float32))
        assert scratch.idle_bytes == 0  # given back and freed at once: it does not count against the peak
    finally:
        scratch.max_idle_bytes, scratch.per_key = DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY
        scratch.clear()


def test_lean_mode_only_with_parameters_on_nvme(tmp_path):
    """Parameters on NVMe (host memory the binding limit) set both; optimizer state alone on NVMe sets neither:
    the page faults of a 128 KiB threshold cost it 40% of its step time (packages/zero-offload/README.md)."""
    from zero_comm.buffers import DEFAULT_MAX_IDLE_BYTES

    tensor = 80_000 * 4
    (tmp_path / "p").mkdir()
    (tmp_path / "o").mkdir()
    param, opt = _run("param", str(tmp_path / "p")), _run("optimizer", str(tmp_path / "o"))
    assert param["mapped_during"] >= 48 * tensor and param["scratch_idle_limit"] == 0, param
    assert opt["mapped_during"] < tensor and opt["scratch_idle_limit"] == DEFAULT_MAX_IDLE_BYTES, opt
