"""The builder of an :class:`OffloadMaster` for the ``offload_optimizer`` section, NVMe's start-up checks done first.

``master_store_for(zero_config, model, world, rank, aio)`` is what an engine calls before it builds the
``ZeroRuntime`` (which calls the builder it returns): it checks ``nvme_path`` (exists, writable, room for the swap
files of the ranks on this machine, bytes computed from the model) and the buffers (``zero_offload.nvme_checks``)
before the runtime exists, and every rank learns whether one failed, so a bad path fails every rank at once with
the same message.
"""

from __future__ import annotations

import torch

from zero_comm import same_outcome
from zero_core.partition_records import logical_shape
from zero_kernels.aio import AioSettings, AsyncIO
from zero_offload.host_memory import keep_no_idle_scratch, return_freed_memory
from zero_offload.master_store import OffloadMaster
from zero_offload.nvme_checks import check_nvme, plan_nvme, ranks_on_this_machine, streams_gradients
from zero_offload.nvme_optimizer import NVMeOptimizer
from zero_offload.param_nvme import NVMeParamStore
from zero_offload.param_store import OffloadParamStore
from zero_offload.swap_folder import SwapFolder
from zero_offload.zenflow import ZenFlowMaster


def trainable_numel(model: torch.nn.Module) -> int:
    """Elements of the floating-point parameters that require a gradient (what the optimizer state covers)."""
    return sum(_numel(p) for p in _trainable(model))


def _trainable(model: torch.nn.Module):
    return (p for p in model.parameters() if p.requires_grad and p.is_floating_point())


def _numel(p: torch.Tensor) -> int:
    """Elements of ``p``'s real value (a parameter partitioned or deferred by zero_core has an empty ``data``)."""
    return logical_shape(p).numel()


def master_store_for(zero_config, model: torch.nn.Module, world: int, rank: int, aio: AioSettings | None = None):
    """The builder (``ZeroRuntime(master_store=...)``) of an ``OffloadMaster`` for ``zero_config.offload_optimizer``
    (of a :class:`ZenFlowMaster` with ``zero_optimization.zenflow``), or None when it is absent or ``device: none``.

    Raises:
        zero_offload.swap_folder.SwapFolderError: ``nvme_path`` missing, not writable or too small for the ranks on
            this machine (bytes needed named), or holding a ``zero_swap/rank<r>`` folder zero did not create.
        zero_offload.nvme_checks.NVMeConfigError: ``buffer_size`` / ``buffer_count`` do not fit the largest
            sub-group or this machine's memory (keys and sizes named).
        With a process group, a failure on any rank is raised on every rank (``zero_comm.same_outcome``).
        ValueError: ``super_offload`` with nvme (named by key).
    """
    section = zero_config.offload_optimizer
    if section is None or section.device == "none":
        return None
    sub = zero_config.sub_group_size
    nvme = None
    if section.device == "nvme":
        largest = max((_numel(p) for p in _trainable(model)), default=0)
        plan = plan_nvme(trainable_numel(model), world, sub, section.buffer_count, largest,
                         stream_grads=streams_gradients(zero_config))  # fmt: skip
        # Every rank checks and creates its folder, then all learn whether one failed (none goes on alone).
        with same_outcome("offload_optimizer start-up checks"):
            check_nvme(section, sub, plan, ranks_on_this_machine(world))
            folder = SwapFolder(section.nvme_path, rank, plan.swap_bytes)
        if rank == 0:
            msg = (f"zero_offload: optimizer state on NVMe: {plan.swap_bytes} bytes of swap files and "
                   f"{plan.buffer_bytes} bytes of host buffers per rank, under {section.nvme_path}")  # fmt: skip
            print(msg, flush=True)

        def nvme(masters, indices, optimizer, out_dtype, cuts=None, stream=None):
            io = AsyncIO(aio or AioSettings(), str(folder.path))
            return NVMeOptimizer(masters, indices, optimizer, folder=folder, io=io, sub_group_size=sub,
                                 buffer_count=section.buffer_count, buffer_numel=plan.buffer_numel,
                                 pipeline_read=section.pipeline_read,
                                 pipeline_write=section.pipeline_write, pin_memory=section.pin_memory,
                                 out_dtype=out_dtype, cuts=cuts, **(stream.options() if stream else {}))  # fmt: skip

    if zero_config.zenflow is not None:  # validated by ZeroConfig: device cpu, stage 1 or 2
        return ZenFlowMaster.builder(zero_config.zenflow, pin_memory=section.pin_memory, sub_group_size=sub)
    return OffloadMaster.builder(section.device, pin_memory=section.pin_memory, ratio=section.ratio,
                                 super_offload=section.super_offload, cpuadam_cores_perc=section.cpuadam_cores_perc,
                                 sub_group_size=sub, nvme=nvme)  # fmt: skip


def param_store_for(zero_config, model: torch.nn.Module | None = None, world: int = 1, rank: int = 0,
                    aio: AioSettings | None = None):  # fmt: skip
    """The parameter store builder for ``ZeroRuntime(param_store=...)``: an :class:`OffloadParamStore`
    (``offload_param`` device cpu: zero_core's ``Stage3`` with its shards in host memory) or an
    :class:`NVMeParamStore` (device nvme, in swap files, after the ``nvme_path`` checks), or None when the section
    is absent or ``device: none``. Device nvme also makes the process's host memory lean (``return_freed_memory``,
    ``keep_no_idle_scratch``: process-wide, as mallopt).

    Raises:
        zero_offload.swap_folder.SwapFolderError: ``nvme_path`` missing, not writable or too small (bytes needed
            named), or holding a ``zero_swap/rank<r>.params`` folder zero did not create.
    """
    section = zero_config.offload_param
    if section is None or section.device == "none":
        return None
    if section.device == "cpu":
        return OffloadParamStore(pin_memory=section.pin_memory)
    # Host memory is the binding limit here (ZeRO-Infinity): peak resident memory must follow the buffers and one
    # unit, not every unit ever freed (glibc's heap) nor idle pooled buffers. Costs page faults on every large
    # tensor (activations included): 20m Llama, 2 ranks, optimizer state on NVMe measured 1.44 s/step with it and
    # 1.03 s without, so offload_optimizer on NVMe alone keeps glibc's default (docs/benchmarks.md, nvme section).
    return_freed_memory()
    keep_no_idle_scratch()
    numel = sum(_numel(p) for p in model.parameters() if p.is_floating_point()) if model is not None else 0
    need = (-(-numel // max(1, world)) + 1024 * world) * 4 + 4096 * 64  # fp32 upper bound, per-unit padding
    name = f"rank{rank}.params"  # rank<r>.params.<k> while that one is in use (SwapFolder)
    folder = SwapFolder(section.nvme_path, rank, need, key="offload_param.nvme_path", name=name)
    io = AsyncIO(aio or AioSettings(), str(folder.path))
    return NVMeParamStore(folder, io, pin_memory=section.pin_memory, buffer_count=section.buffer_count,
                          buffer_size=section.buffer_size, max_in_cpu=section.max_in_cpu)  # fmt: skip
