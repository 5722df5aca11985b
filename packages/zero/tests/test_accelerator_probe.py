"""``deepspeed.accelerator`` and the op probes answer as DeepSpeed 0.19.8's CPU accelerator (this is a CPU run).

Expected values come from the machine itself (``/proc/meminfo``, ``os.sysconf``, ``/sys/devices/system/node``) by
the rules of DeepSpeed's ``cpu_accelerator.py``.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import zero as deepspeed
from zero.device import Accelerator, is_current_accelerator_supported


@pytest.fixture
def cpu():
    return Accelerator("cpu")


def test_cpu_answers(cpu, monkeypatch):
    assert is_current_accelerator_supported() is True
    assert cpu.is_synchronized_device() is True and cpu.use_host_timers() is True
    assert cpu.resolves_data_dependency() is True and cpu.handles_memory_backpressure() is True
    fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    assert cpu.supported_dtypes() == [torch.float32, torch.bfloat16] + ([torch.float16] if fp16 else [])
    assert cpu.is_fp16_supported() is fp16 and cpu.is_bf16_supported() is True and cpu.is_triton_supported() is False
    assert cpu.on_accelerator(torch.ones(1)) is True and cpu.on_accelerator(torch.ones(1, device="meta")) is False


def test_cpu_device_count_follows_local_size_then_numa_nodes(cpu, monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert cpu.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "0")
    lists = [open(p).read().strip() for p in sorted(glob.glob("/sys/devices/system/node/node[0-9]*/cpulist"))]
    distinct = [c for i, c in enumerate(lists) if c and (i == 0 or c != lists[i - 1])]
    assert cpu.device_count() == max(1, len(distinct))
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() == max(1, len(distinct))


def test_cpu_memory_is_the_machines(cpu):
    total = cpu.total_memory()
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # the kernel's totalram, as psutil reads it
    assert abs(total - pages) <= 4096 * 1024 and isinstance(total, int)
    available = cpu.available_memory()
    assert isinstance(available, int) and 0 < available <= total


def test_op_probes():
    ops = deepspeed.ops.__compatible_ops__
    assert ops is deepspeed.ops.__compatible_ops__  # one dict: a script's edits persist
    assert ops["cpu_adam"] is True and ops["fused_adam"] is True and ops["async_io"] is True
    assert ops["cpu_lion"] is False and ops["deepspeed_not_implemented"] is False
    from zero.op_builders import CPUAdamBuilder, CPULionBuilder, NotImplementedBuilder

    assert CPUAdamBuilder().is_compatible() and CPUAdamBuilder.NAME == "cpu_adam"
    assert CPULionBuilder is NotImplementedBuilder and not CPULionBuilder().is_compatible()
    with pytest.raises(deepspeed.NotSupportedError, match="not implemented by zero"):
        CPULionBuilder().load()
    acc = deepspeed.accelerator.get_accelerator()
    assert acc.get_op_builder("CPUAdamBuilder") is CPUAdamBuilder
    assert acc.get_op_builder("NoSuchBuilder") is NotImplementedBuilder
    assert isinstance(acc.create_op_builder("FusedAdamBuilder"), deepspeed.ops.op_builder.FusedAdamBuilder)
    with pytest.raises(deepspeed.NotSupportedError, match="fused_adam"):
        acc.create_op_builder("FusedAdamBuilder").load()  # no CUDA here: torch's AdamW serves it
    module = CPUAdamBuilder().load()  # zero_kernels' C++ CPU Adam (built on first use, cached)
    assert module is __import__("zero_kernels").load("cpu_adam")
