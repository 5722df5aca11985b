"""Start-up checks of NVMe optimizer offload, computed from the model before any buffer or file exists.

DeepSpeed sizes its optimizer swap buffers from the largest sub-group and fails mid-run ("Not enough buffers")
when ``buffer_count`` cannot hold the tensors it swaps at once, and it learns that ``nvme_path`` is full when a
write fails. Here one host buffer holds a whole sub-group (fp32 master + the two Adam moments, 12 bytes per element),
so any ``buffer_count`` >= 1 runs; what can go wrong is known from the model up front and is reported then:

* ``buffer_size`` set under ``offload_optimizer`` (a cap on the elements of one buffer) below what the largest
  sub-group needs: a config error naming ``buffer_size`` and ``sub_group_size`` and the size needed;
* the buffers (``buffer_count`` x the largest sub-group) of the ranks on this machine exceed its available memory: a
  config error naming ``buffer_count`` and ``sub_group_size`` and the bytes needed;
* ``nvme_path`` missing, not writable, or without room for the swap files of every rank on this machine (bytes
  needed computed here and printed in the error): ``SwapFolderError``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from zero_offload.nvme_optimizer import swap_bytes
from zero_offload.swap_folder import check_room

_KEY = "zero_optimization.offload_optimizer"
_STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per element in a buffer and in the swap files
_PAGE_ELEMS = 1024  # fp32 elements per 4 KiB: each segment of a buffer is padded to whole pages (O_DIRECT)


class NVMeConfigError(ValueError):
    """The ``offload_optimizer`` buffers do not fit what the model needs (message names the keys and sizes)."""


@dataclass(frozen=True)
class NVMePlan:
    """What optimizer state on NVMe takes on one rank (upper bounds computed from the model; sizes in elements or
    bytes as named).

    Attributes:
        elements: trainable elements of the rank's master shards (its 1/world share, rounded up, plus padding).
        largest_sub_group: elements of the largest sub-group at most: min(``sub_group_size``, ``elements``, the
            largest parameter).
        buffer_numel: elements of one buffer's segment, as DeepSpeed sizes its pool: its largest sub-group, whole
            parameters coalesced up to ``sub_group_size`` (min(``sub_group_size``, ``elements``)); with streamed
            gradients ``largest_sub_group``.
        buffers: ``buffer_count``: the buffers, laid end to end as one swap ring (``zero_offload.swap_ring``).
        buffer_bytes: host bytes of the ring (``buffers`` x 3 page-padded segments of ``buffer_numel``, or 4 with
            streamed gradients, plus their two staging buffers), at most about every sub-group's segments at once.
        swap_bytes: bytes of the rank's swap files.
    """

    elements: int
    largest_sub_group: int
    buffer_numel: int
    buffers: int
    buffer_bytes: int
    swap_bytes: int


def plan_nvme(numel: int, world: int, sub_group_size: int, buffer_count: int, largest_param: int = 0,
              stream_grads: bool = False) -> NVMePlan:  # fmt: skip
    """The per-rank plan for ``numel`` trainable elements sharded over ``world`` ranks; ``largest_param`` (elements
    of the largest trainable parameter, 0: unknown) bounds the largest sub-group, as sub-groups end at parameter
    boundaries; ``stream_grads``: the files and buffers also hold each sub-group's gradient (stage 3).

    Raises:
        ValueError: ``world``, ``sub_group_size`` or ``buffer_count`` < 1.
    """
    if min(world, sub_group_size, buffer_count) < 1:
        raise ValueError(f"plan_nvme: world, sub_group_size and buffer_count must be >= 1, got {world}, "
                         f"{sub_group_size}, {buffer_count}")  # fmt: skip
    share = -(-numel // world) + 1024 * world  # per-bucket padding, generously
    largest = min(sub_group_size, share, largest_param or share)
    # streamed gradients: the reads wait for backward's last gradient anyway, and host memory is the point of
    # that mode (ZeRO-Infinity): buffers of the largest sub-group here, not DeepSpeed's coalesced one
    buffer_numel = largest if stream_grads else min(sub_group_size, share)
    padded = -(-largest // _PAGE_ELEMS) * _PAGE_ELEMS
    per_buffer = -(-buffer_numel // _PAGE_ELEMS) * _PAGE_ELEMS * 4
    segs = 3 + int(stream_grads)
    swap = swap_bytes([share], sub_group_size, stream_grads) + 4096 * segs
    # no more than every sub-group at once, plus the wrap's slack of one sub-group (as NVMeOptimizer sizes it)
    ring = min(buffer_count * segs * per_buffer, swap + segs * padded * 4)
    return NVMePlan(share, largest, buffer_numel, buffer_count, ring + (2 * padded * 4 if stream_grads else 0), swap)


def streams_gradients(zero_config) -> bool:
    """Whether NVMe optimizer offload streams gradients to its swap files (ZeRO-Infinity): stage 3 with
    ``offload_param`` on cpu or nvme, as ``OffloadMaster.attach`` decides at run time."""
    param = getattr(zero_config.offload_param, "device", "none")
    return zero_config.stage == 3 and param in ("cpu", "nvme")


def available_memory() -> int | None:
    """Bytes this process may still allocate: ``MemAvailable`` of /proc/meminfo, lowered by a cgroup v2 limit when
    one is set; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            found.append(int(limit) - used)
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_nvme(section, sub_group_size: int, plan: NVMePlan, ranks_here: int, available: int | None = None) -> None:
    """Check the ``offload_optimizer`` section (device nvme) against ``plan`` for ``ranks_here`` ranks on this
    machine sharing ``nvme_path``, before anything is allocated or written.

    Args:
        section: the ``offload_optimizer`` config (``zero_core.config.OffloadConfig``).
        sub_group_size: ``zero_optimization.sub_group_size``.
        plan: from :func:`plan_nvme`.
        ranks_here: ranks on this machine (they share its memory and, usually, ``nvme_path``).
        available: host bytes available (default: :func:`available_memory`).

    Raises:
        NVMeConfigError: ``buffer_size`` (when set) below 3 x the largest sub-group, or the buffers of the ranks here
            larger than the available memory; both name the keys and the size needed.
        zero_offload.swap_folder.SwapFolderError: ``nvme_path`` missing, not writable, or short of
            ``ranks_here`` x ``plan.swap_bytes`` bytes.
    """
    need = 3 * plan.largest_sub_group
    if "buffer_size" in section.model_fields_set and section.buffer_size < need:
        raise NVMeConfigError(f"{_KEY}.buffer_size={section.buffer_size} elements is too small: one buffer holds a "
                              f"whole sub-group's fp32 master and two Adam moments, 3 x {plan.largest_sub_group} = "
                              f"{need} elements for the largest sub-group (zero_optimization.sub_group_size="
                              f"{sub_group_size}); set buffer_size >= {need} or lower sub_group_size")  # fmt: skip
    available = available_memory() if available is None else available
    total = plan.buffer_bytes * ranks_here
    if available is not None and total > available:
        raise NVMeConfigError(f"{_KEY}.buffer_count={section.buffer_count}: {plan.buffers} host buffers of 3 x "
                              f"{plan.buffer_numel} fp32 elements (a sub-group, zero_optimization."
                              f"sub_group_size={sub_group_size}) take {plan.buffer_bytes} bytes per rank, {total} for "
                              f"the {ranks_here} rank(s) on this machine, which has {available} bytes available; "
                              f"lower sub_group_size or buffer_count")  # fmt: skip
    who = f"the {ranks_here} rank(s) on this machine ({plan.swap_bytes} bytes each)"
    check_room(section.nvme_path, plan.swap_bytes * ranks_here, who=who)


def ranks_on_this_machine(world: int) -> int:
    """``LOCAL_WORLD_SIZE`` (set by torchrun) or, without it, ``world`` (one machine)."""
    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        return max(1, world)
