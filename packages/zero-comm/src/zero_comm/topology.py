"""Process-group topology: the data-parallel group and ZeRO++ hpZ node-local (secondary) groups.

``torch.distributed.new_group`` must be called by every rank of the default group, for every new group, in the
same order, even by ranks not in that group; the helpers here do exactly that, so call them on every rank.
Nodes can be emulated on one machine: ``hierarchical_groups(group, secondary_size=2)`` on 4 ranks makes nodes
{0, 1} and {2, 3}, as ``zero_hpz_partition_size=2`` does in DeepSpeed.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist


def _require_initialized(name: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name}: torch.distributed is not initialised; call dist.init_process_group first")


def data_parallel_group(ranks: Sequence[int] | None = None) -> dist.ProcessGroup:
    """The data-parallel process group: every rank (``dist.group.WORLD``) or a new group of ``ranks``.

    Call on every rank with the same ``ranks`` (new_group is collective over the default group).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: ``ranks`` is empty, has duplicates or ranks outside ``[0, world)``.
    """
    _require_initialized("data_parallel_group")
    if ranks is None:
        return dist.group.WORLD
    world = dist.get_world_size()
    ranks = list(ranks)
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
        raise ValueError(f"ranks must be distinct global ranks in [0, {world}), got {ranks}")
    return dist.new_group(ranks)


@dataclass(frozen=True)
class HierarchicalGroups:
    """This rank's place in a node-by-node layout of a data-parallel group (hpZ, qgZ).

    Attributes:
        group: the whole data-parallel group (size ``num_nodes * node_size``).
        intra: this rank's node: ``node_size`` consecutive ranks of ``group`` (hpZ's secondary partition group).
        inter: the ranks of ``group`` with this rank's local index on every node (size ``num_nodes``).
        node_size, num_nodes: layout; ``node`` and ``local_rank`` place this rank (its group rank is
            ``node * node_size + local_rank``).
        intra_ranks, inter_ranks: global ranks of ``intra`` and ``inter``, in group order.
    """

    group: dist.ProcessGroup
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    node_size: int
    num_nodes: int
    node: int
    local_rank: int
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]


def hierarchical_groups(group: dist.ProcessGroup, secondary_size: int | None = None) -> HierarchicalGroups:
    """Split ``group`` into nodes of ``secondary_size`` consecutive ranks, with intra- and inter-node groups.

    Args:
        group: the data-parallel group (``dist.group.WORLD`` or from :func:`data_parallel_group`).
        secondary_size: ranks per node (hpZ's secondary partition size). None: ``LOCAL_WORLD_SIZE`` from the
            environment (set by torchrun), else the whole group (one node).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: ``secondary_size`` < 1 or does not divide the group size.
    Mirrors the layout of DeepSpeed's ``_create_zero_param_parallel_group`` (hpZ) with our own code.
    """
    _require_initialized("hierarchical_groups")
    ranks = dist.get_process_group_ranks(group)
    world = len(ranks)
    if secondary_size is None:
        secondary_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if isinstance(secondary_size, bool) or not isinstance(secondary_size, int) or secondary_size < 1:
        raise ValueError(f"secondary_size must be an int >= 1, got {secondary_size!r}")
    if world % secondary_size:
        raise ValueError(f"secondary_size {secondary_size} must divide the group size {world}")
    num_nodes = world // secondary_size
    me = group.rank()
    node, local = divmod(me, secondary_size)
    intra = inter = None
    # Same order on every rank: all intra groups, then all inter groups.
    for n in range(num_nodes):
        members = ranks[n * secondary_size : (n + 1) * secondary_size]
        pg = dist.new_group(members) if num_nodes > 1 else group
        if n == node:
            intra, intra_ranks = pg, tuple(members)
    for j in range(secondary_size):
        members = ranks[j::secondary_size]
        pg = dist.new_group(members) if secondary_size > 1 else group
        if j == local:
            inter, inter_ranks = pg, tuple(members)
    return HierarchicalGroups(group, intra, inter, secondary_size, num_nodes, node, local, intra_ranks, inter_ranks)


@dataclass(frozen=True)
class LaunchTopology:
    """Where this process sits in the launch, as torchrun's agent describes it in the environment.

    Attributes:
        rank, world_size: global rank and number of ranks (``RANK``, ``WORLD_SIZE``).
        local_rank, local_world_size: rank and ranks on this node (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
        node_rank, num_nodes: this node and the nodes of the launch (``GROUP_RANK``, ``GROUP_WORLD_SIZE``; when
            absent, ``RANK // LOCAL_WORLD_SIZE`` and ``WORLD_SIZE // LOCAL_WORLD_SIZE``).
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int


def launch_topology(env: dict | None = None) -> LaunchTopology:
    """:class:`LaunchTopology` from ``env`` (default ``os.environ``); one node of one rank without a launcher.

    Raises:
        ValueError: a variable that is not an integer, or values that contradict each other (naming them).
    """
    env = os.environ if env is None else env

    def get(name: str, default: int) -> int:
        value = env.get(name)
        if value is None or value == "":
            return default
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"environment variable {name}={value!r} is not an integer") from None

    world = get("WORLD_SIZE", 1)
    rank = get("RANK", 0)
    local_world = get("LOCAL_WORLD_SIZE", world)
    local_rank = get("LOCAL_RANK", rank % max(local_world, 1))
    node_rank = get("GROUP_RANK", rank // max(local_world, 1))
    num_nodes = get("GROUP_WORLD_SIZE", world // max(local_world, 1))
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world and 0 <= node_rank < num_nodes <= world):
        raise ValueError(f"inconsistent launch environment: RANK={rank} WORLD_SIZE={world} LOCAL_RANK="
                         f"{local_rank} LOCAL_WORLD_SIZE={local_world} GROUP_RANK={node_rank} "
                         f"GROUP_WORLD_SIZE={num_nodes}")  # fmt: skip
    return LaunchTopology(rank, world, local_rank, local_world, node_rank, num_nodes)
