"""Expert-parallel and expert-data-parallel process groups, under DeepSpeed's names (``deepspeed.utils.groups``).

Expert parallelism borrows ranks from data parallelism: with world W and ``ep_size`` P (P divides W), the
expert-parallel groups are P consecutive ranks ``[i*P, (i+1)*P)`` (the all-to-all runs there; each rank holds
E / P experts) and the expert-data-parallel groups ``{j, j+P, j+2P, ...}`` are the W / P ranks holding the same
experts (their gradients are reduced there; everything else over the whole data-parallel group). With
``use_data_before_expert_parallel_`` the roles swap (D + E): expert-data-parallel groups are consecutive blocks
of W / P ranks and expert-parallel groups strided by W / P. Groups are named ``"ep_size_<P>"`` and created once
per name on every rank (``torch.distributed.new_group`` is collective: every rank must call in the same order).
Mirrors DeepSpeed 0.19.8's ``_create_expert_and_data_parallel`` without tensor or pipeline parallelism.
"""

from __future__ import annotations

import torch.distributed as dist


class ExpertGroups:
    """The expert groups this rank belongs to, by name (``"ep_size_<P>"``), with their global ranks."""

    def __init__(self) -> None:
        self.expert_parallel: dict[str, dist.ProcessGroup] = {}  # name -> this rank's expert-parallel group
        self.expert_parallel_ranks: dict[str, list[int]] = {}  # name -> its global ranks
        self.expert_data_parallel: dict[str, dist.ProcessGroup] = {}  # name -> this rank's expert-data group
        self.expert_data_parallel_ranks: dict[str, list[int]] = {}  # name -> its global ranks
        self._world = None  # the default process group the groups were made in: a new one makes them stale

    def create(self, ep_size: int, use_data_before_expert_parallel_: bool = False) -> str:
        """Create the groups for ``ep_size`` unless they exist; returns their name. Collective (every rank).

        Raises:
            RuntimeError: torch.distributed is not initialized.
            ValueError: ``ep_size`` not a positive integer or not dividing the world size (every rank raises:
                the arguments and the world size are the same everywhere).
        """
        if not dist.is_initialized():
            raise RuntimeError("expert-parallel groups need torch.distributed initialized (deepspeed.init_distributed "
                               "or zero.init_distributed) before the MoE layer's groups are created")  # fmt: skip
        world = dist.get_world_size()
        if int(ep_size) != ep_size or ep_size < 1 or world % ep_size:
            raise ValueError(f"MoE ep_size={ep_size} must be a positive integer dividing the world size {world} "
                             "(expert parallelism borrows its ranks from data parallelism)")  # fmt: skip
        name = group_name(ep_size)
        self._forget_stale()
        if name in self.expert_parallel:
            return name
        self._world = dist.group.WORLD
        rank, blocks = dist.get_rank(), world // ep_size
        if use_data_before_expert_parallel_:
            edp = [list(range(j * blocks, (j + 1) * blocks)) for j in range(ep_size)]
            ep = [list(range(i, world, blocks)) for i in range(blocks)]
        else:
            edp = [list(range(j, world, ep_size)) for j in range(ep_size)]
            ep = [list(range(i * ep_size, (i + 1) * ep_size)) for i in range(blocks)]
        for ranks in edp:  # DeepSpeed's order: expert-data-parallel groups first
            group = dist.new_group(ranks)
            if rank in ranks:
                self.expert_data_parallel[name], self.expert_data_parallel_ranks[name] = group, ranks
        for ranks in ep:
            group = dist.new_group(ranks)
            if rank in ranks:
                self.expert_parallel[name], self.expert_parallel_ranks[name] = group, ranks
        return name

    def _forget_stale(self) -> None:
        if self._world is not None and self._world is not dist.group.WORLD:
            self.clear()  # torch.distributed was destroyed and initialized again since they were made

    def expert_parallel_group(self, name: str):
        """This rank's expert-parallel group ``name``; KeyError naming the groups that exist."""
        self._forget_stale()
        return _lookup(self.expert_parallel, name, "expert-parallel")

    def expert_data_parallel_group(self, name: str):
        """This rank's expert-data-parallel group ``name``; KeyError naming the groups that exist."""
        self._forget_stale()
        return _lookup(self.expert_data_parallel, name, "expert-data-parallel")

    def clear(self) -> None:
        """Forget every group (the process groups themselves are torch's; a new init_process_group makes new)."""
        self.expert_parallel.clear()
        self.expert_parallel_ranks.clear()
        self.expert_data_parallel.clear()
        self.expert_data_parallel_ranks.clear()
        self._world = None


def group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups for ``ep_size``."""
    return f"ep_size_{int(ep_size)}"


def _lookup(table: dict, name: str, what: str):
    if name not in table:
        raise KeyError(f"no {what} group named {name!r} was created (existing: {sorted(table) or 'none'}); the MoE "
                       "layer creates it in set_deepspeed_parallelism(), which initialize() calls")  # fmt: skip
    return table[name]


EXPERT_GROUPS = ExpertGroups()
"""This process's expert groups (DeepSpeed keeps them in ``deepspeed.utils.groups``' module state)."""


# DeepSpeed's functions over them (deepspeed.utils.groups): Megatron-DeepSpeed and the MoE layer call these.
def _create_expert_and_data_parallel(expert_parallel_size_, use_data_before_expert_parallel_=False):
    """Create the groups for ``expert_parallel_size_`` (see :meth:`ExpertGroups.create`)."""
    EXPERT_GROUPS.create(expert_parallel_size_, use_data_before_expert_parallel_)


def _get_expert_parallel_group(group_name):
    return EXPERT_GROUPS.expert_parallel_group(group_name)


def _get_expert_data_parallel_group(group_name):
    return EXPERT_GROUPS.expert_data_parallel_group(group_name)


def _get_expert_parallel_group_ranks(group_name):
    EXPERT_GROUPS.expert_parallel_group(group_name)
    return EXPERT_GROUPS.expert_parallel_ranks[group_name]


def _get_expert_data_parallel_group_ranks(group_name):
    EXPERT_GROUPS.expert_data_parallel_group(group_name)
    return EXPERT_GROUPS.expert_data_parallel_ranks[group_name]


def _get_expert_parallel_group_dict():
    return EXPERT_GROUPS.expert_parallel


def _get_expert_data_parallel_group_dict():
    return EXPERT_GROUPS.expert_data_parallel


def _get_expert_parallel_world_size(group_name):
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name):
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name):
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name):
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name):
    """The global rank of local rank 0 in this rank's expert-parallel group."""
    return _get_expert_parallel_group_ranks(group_name)[0]


def _get_expert_broadcast_src_rank(group_name):
    """The global rank of local rank 0 in this rank's expert-data-parallel group."""
    return _get_expert_data_parallel_group_ranks(group_name)[0]


def _get_max_expert_size():
    """The largest ``ep_size`` whose groups exist, None when none do."""
    sizes = [int(name.rsplit("_", 1)[1]) for name in EXPERT_GROUPS.expert_parallel]
    return max(sizes) if sizes else None


def _get_max_expert_size_name():
    return group_name(_get_max_expert_size() or 0)


def _get_max_expert_parallel_group():
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size():
    """Experts are not tensor-parallel here: 1 (DeepSpeed's default)."""
    return 1
