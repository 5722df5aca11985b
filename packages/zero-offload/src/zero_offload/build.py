"""Build an :class:`OffloadMaster` from the ``offload_optimizer`` section, with NVMe's start-up checks done first.

``master_store_for(zero_config, model, world, rank, aio)`` is what an engine calls before it builds the
``ZeroRuntime``: it checks ``nvme_path`` (exists, writable, room for this rank's swap files, bytes computed from
the model) before any collective runs, so a bad path fails every rank at once with the same message.
"""

from __future__ import annotations

import torch

from zero_kernels.aio import AioSettings, AsyncIO
from zero_offload.master_store import OffloadMaster
from zero_offload.nvme_optimizer import NVMeOptimizer, swap_bytes
from zero_offload.param_nvme import NVMeParamStore, param_folder_name
from zero_offload.param_store import OffloadParamStore
from zero_offload.swap_folder import SwapFolder


def nvme_bytes_needed(model: torch.nn.Module, world: int, sub_group_size: int) -> int:
    """Upper bound of one rank's swap-file bytes: its 1/world share of the trainable elements (rounded up, one
    shard per parameter dtype and group at most) as fp32 master + two Adam moments, padded to 4 KiB per sub-group."""
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad and p.is_floating_point())
    share = -(-numel // max(1, world)) + 1024 * world  # per-bucket padding, generously
    return swap_bytes([share], sub_group_size) + 4096 * 3


def master_store_for(zero_config, model: torch.nn.Module, world: int, rank: int, aio: AioSettings | None = None):
    """An ``OffloadMaster`` for ``zero_config.offload_optimizer``, or None when it is absent or ``device: none``.

    Raises:
        zero_offload.swap_folder.SwapFolderError: ``nvme_path`` missing, not writable or too small (bytes needed
            named), or holding a ``zero_swap/rank<r>`` folder zero did not create.
        ValueError: ``super_offload`` with nvme (named by key).
    """
    section = zero_config.offload_optimizer
    if section is None or section.device == "none":
        return None
    sub = zero_config.sub_group_size
    nvme = None
    if section.device == "nvme":
        folder = SwapFolder(section.nvme_path, rank, nvme_bytes_needed(model, world, sub))

        def nvme(masters, indices, optimizer, out_dtype, cuts=None):
            io = AsyncIO(aio or AioSettings(), str(folder.path))
            return NVMeOptimizer(masters, indices, optimizer, folder=folder, io=io, sub_group_size=sub,
                                 buffer_count=section.buffer_count, pipeline_read=section.pipeline_read,
                                 pipeline_write=section.pipeline_write, pin_memory=section.pin_memory,
                                 out_dtype=out_dtype, cuts=cuts)  # fmt: skip

    return OffloadMaster(section.device, pin_memory=section.pin_memory, ratio=section.ratio,
                         super_offload=section.super_offload, cpuadam_cores_perc=section.cpuadam_cores_perc,
                         sub_group_size=sub, nvme=nvme)  # fmt: skip


def param_store_for(zero_config, model: torch.nn.Module | None = None, world: int = 1, rank: int = 0,
                    aio: AioSettings | None = None):  # fmt: skip
    """An :class:`OffloadParamStore` (``offload_param`` device cpu) or :class:`NVMeParamStore` (device nvme, after
    the ``nvme_path`` checks), or None when the section is absent or ``device: none``.

    Raises:
        zero_offload.swap_folder.SwapFolderError: ``nvme_path`` missing, not writable or too small (bytes needed
            named), or holding a ``zero_swap/rank<r>.params`` folder zero did not create.
    """
    section = zero_config.offload_param
    if section is None or section.device == "none":
        return None
    if section.device == "cpu":
        return OffloadParamStore(pin_memory=section.pin_memory)
    numel = sum(p.numel() for p in model.parameters() if p.is_floating_point()) if model is not None else 0
    need = (-(-numel // max(1, world)) + 1024 * world) * 4 + 4096 * 64  # fp32 upper bound, per-unit padding
    name = param_folder_name(section.nvme_path, rank)
    folder = SwapFolder(section.nvme_path, rank, need, key="offload_param.nvme_path", name=name)
    io = AsyncIO(aio or AioSettings(), str(folder.path))
    return NVMeParamStore(folder, io, pin_memory=section.pin_memory, buffer_count=section.buffer_count,
                          buffer_size=section.buffer_size, max_in_cpu=section.max_in_cpu)  # fmt: skip
