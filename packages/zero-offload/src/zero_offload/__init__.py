"""CPU and NVMe offload of ZeRO optimizer state and stage-3 parameters (ZeRO-Offload, SuperOffload, ZeRO-Infinity's
optimizer part).

Public API:
    OffloadMaster: zero_core's master-store variation point with masters and optimizer state in host memory or on
        NVMe (``ZeroRuntime(..., master_store=OffloadMaster.builder(device, **keys))``, the keys an
        :class:`OffloadOptions`); ``master_store_for(zero_config, model, world, rank, aio)`` gives its builder for the
        ``offload_optimizer`` section after NVMe's start-up checks.
    HostOptimizer: fp32 master shards + optimizer state in host memory, CPU Adam's one-pass step, Twin-Flow ratio.
    HostShards, NVMeShards: storage policies of zero_core's stage-3 store (``zero_core.shard_storage``): its
        shards in host memory between uses (``offload_param`` cpu) or in swap files (``offload_param`` nvme);
        OffloadParamStore / NVMeParamStore: the builders of that store for ``ZeroRuntime(param_store=...)``;
        ``param_store_for(zero_config, model, world, rank, aio)`` gives either from the config.
    SpeculativeStep: SuperOffload's step during backward with exact rollback.
    ZenFlowMaster, HostUpdate: ZenFlow (``zero_optimization.zenflow``): the important columns stepped on the device
        every step, the rest on the host every ``update_interval`` steps; ``trace`` records the host updates.
    NVMeOptimizer, SwapFolder, swap_bytes: optimizer state in swap files, pipelined through buffer_count buffers.
    plan_sub_groups, SubGroup: the sub-group plan (``sub_group_size``).
    host_empty: host buffers, pinned when possible (``pin_memory`` falls back with one warning).
"""

from importlib.metadata import version as _version

from zero_offload.build import master_store_for, param_store_for
from zero_offload.host_memory import host_empty
from zero_offload.host_optimizer import HostOptimizer
from zero_offload.master_store import OffloadMaster, OffloadOptions
from zero_offload.nvme_optimizer import NVMeOptimizer, swap_bytes
from zero_offload.param_nvme import NVMeParamStore, NVMeShards
from zero_offload.param_store import HostShards, OffloadParamStore
from zero_offload.speculative import SpeculativeStep
from zero_offload.subgroups import SubGroup, plan_sub_groups
from zero_offload.swap_folder import SwapFolder, SwapFolderError
from zero_offload.zenflow import HostUpdate, ZenFlowMaster

__version__ = _version("zero-offload")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "HostOptimizer",
    "HostShards",
    "HostUpdate",
    "NVMeOptimizer",
    "NVMeParamStore",
    "NVMeShards",
    "OffloadMaster",
    "OffloadOptions",
    "OffloadParamStore",
    "SpeculativeStep",
    "SubGroup",
    "SwapFolder",
    "SwapFolderError",
    "ZenFlowMaster",
    "host_empty",
    "master_store_for",
    "param_store_for",
    "plan_sub_groups",
    "swap_bytes",
]
