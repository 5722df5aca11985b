"""DeepSpeed's process topologies and pipeline grid: ranks as coordinates on named axes, and the process groups
of a pipeline run (``deepspeed.runtime.pipe.topology``).

Layout (DeepSpeed's): row-major over the axes in the order given, the last axis varying fastest. With
``PipeDataParallelTopology(num_pp, num_dp)`` the axes are ``("pipe", "data")``, so the data-parallel ranks of one
stage are consecutive; ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` orders them
``("pipe", "data", "model")``.
"""

from __future__ import annotations

import itertools
from collections import namedtuple

import torch.distributed as dist


class ProcessTopology:
    """A bijection between global ranks and coordinates on named axes (DeepSpeed's ``ProcessTopology``).

    Args:
        axes: the axis names, outermost first.
        dims: the length of each axis (ints >= 1).

    Raises:
        ValueError: axes and dims differ in length, an axis repeats, or a length is not an int >= 1.
    """

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: {len(axes)} axes {axes} but {len(dims)} dims {dims}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be distinct, got {axes}")
        for axis, d in zip(axes, dims, strict=True):
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"ProcessTopology: the length of axis {axis!r} must be an int >= 1, got {d!r}")
        self.axes = axes
        self.dims = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # DeepSpeed's coordinate type, one field per axis
        coords = itertools.product(*(range(d) for d in dims))
        self.mapping = {self.ProcessCoord(*c): rank for rank, c in enumerate(coords)}  # coordinate -> global rank
        self._coords = list(self.mapping)  # global rank -> coordinate

    def get_rank(self, **coord_kwargs) -> int:
        """The global rank at the coordinate given by one keyword per axis.

        Raises:
            ValueError: not every axis is given (use :meth:`filter_match` for slices), or a coordinate is out of
                range."""
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank() needs one coordinate per axis {self.axes}, got {sorted(coord_kwargs)}; "
                             "use filter_match() for slices")  # fmt: skip
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank(): coordinate {coord_kwargs} is outside the topology {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return self.axes

    def get_rank_repr(self, rank: int, omit_axes=("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"):
        """The coordinate of ``rank`` as text (``"model_01"``), leaving out ``omit_axes`` (checkpoint names)."""
        coord = self.get_coord(rank)
        kept = [a for a in self.axes if a not in frozenset(omit_axes)]
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in kept)

    def get_dim(self, axis: str) -> int:
        """The length of ``axis``; 0 for an axis the topology lacks (DeepSpeed's answer)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int):
        """The coordinate (a ``ProcessCoord`` namedtuple) of global ``rank``.

        Raises:
            ValueError: ``rank`` is not in ``0 .. world_size() - 1``."""
        if not isinstance(rank, int) or not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank!r} not found in topology (world size {len(self._coords)})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups along ``axis``: for each coordinate of the other axes (in row-major order), the ranks that
        differ only in ``axis``, ordered by it. Empty for an axis the topology lacks."""
        if axis not in self.axes:
            return []
        k = self.axes.index(axis)
        others = [range(d) for i, d in enumerate(self.dims) if i != k]
        lists = []
        for rest in itertools.product(*others):
            lists.append([self.mapping[self.ProcessCoord(*rest[:k], i, *rest[k:])] for i in range(self.dims[k])])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The global ranks whose coordinates equal every given ``axis=value``, ascending."""
        return [r for r, c in enumerate(self._coords) if all(getattr(c, a) == v for a, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The global ranks whose coordinate on ``axis`` is ``idx``, ascending."""
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        """The number of ranks (the product of the dims)."""
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Axes ``("pipe", "data")`` of lengths ``(num_pp, num_dp)`` (DeepSpeed's)."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes ``("pipe", "data", "model")`` of lengths ``(num_pp, num_dp, num_mp)`` (DeepSpeed's)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """The process groups of a pipeline run over ``topology`` (DeepSpeed's ``PipelineParallelGrid``), with its
    ``mpu`` getters (``get_pipe_parallel_*``, ``get_data_parallel_*``, ``get_model_parallel_*``,
    ``get_slice_parallel_*``).

    Groups: ``dp`` (one stage and model coordinate, all data coordinates: ZeRO shards and averages here), ``pp``
    (one pipeline: its ranks ordered by stage, so a rank's group rank is its stage and point-to-point peers are
    stage indices), model parallel (one data coordinate: every stage and model coordinate; DeepSpeed's
    ``get_model_parallel_*``), slice (one stage and data coordinate: the tensor-parallel ranks; None when the
    topology has no ``model`` axis longer than 1). Every rank creates every group (collective).

    Raises (``__init__``): ValueError when ``topology`` lacks a ``pipe`` or ``data`` axis or its size is not the
    default group's world size.
    """

    def __init__(self, topology: ProcessTopology) -> None:
        world = dist.get_world_size()
        for axis in ("pipe", "data"):
            if axis not in topology.get_axis_names():
                raise ValueError(f"PipelineParallelGrid: the topology needs a {axis!r} axis, has {topology.axes}")
        if topology.world_size() != world:
            raise ValueError(f"PipelineParallelGrid: the topology {dict(zip(topology.axes, topology.dims))} holds "
                             f"{topology.world_size()} ranks but the world size is {world}")  # fmt: skip
        self._topo = topology
        self.global_rank = dist.get_rank()
        self.world_size = world
        coord = topology.get_coord(self.global_rank)
        self.stage_id = coord.pipe
        self.data_parallel_id = coord.data
        self.pipe_parallel_size = topology.get_dim("pipe")
        self.data_parallel_size = topology.get_dim("data")
        self.model_parallel_size = max(topology.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.dp_group, self.dp_proc_group = self._mine(topology.get_axis_comm_lists("data"))
        self.pp_group, self.pp_proc_group = self._mine(topology.get_axis_comm_lists("pipe"))
        model_lists = [topology.get_axis_list("data", d) for d in range(self.data_parallel_size)]
        self.ds_model_group, self.ds_model_proc_group = self._mine(model_lists)
        self.slice_group, self.slice_proc_group = [self.global_rank], None
        if self.model_parallel_size > 1:
            self.slice_group, self.slice_proc_group = self._mine(topology.get_axis_comm_lists("model"))

    def _mine(self, lists: list[list[int]]):
        """Create a group for each rank list (every rank, in the same order) and return this rank's."""
        found = ([], None)
        for ranks in lists:
            group = dist.new_group(ranks=ranks)
            if self.global_rank in ranks:
                found = (ranks, group)
        return found

    def topology(self) -> ProcessTopology:
        """The topology the grid was built from."""
        return self._topo

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of ``stage_id`` at this rank's other coordinates (``kwargs`` override some)."""
        coord = self._topo.get_coord(self.global_rank)._replace(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord._asdict())

    def get_global_rank(self) -> int:
        """This process's global rank."""
        return self.global_rank

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """This rank's data-parallel coordinate (which pipeline it is in)."""
        return self.data_parallel_id

    def get_pipe_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """The number of stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        """This rank's pipeline (its ranks ordered by stage)."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """This rank's data-parallel coordinate."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines."""
        return self.data_parallel_size

    def get_data_parallel_group(self):
        """The ranks holding this rank's stage (and model coordinate) in every pipeline."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        """The global ranks of :meth:`get_data_parallel_group`."""
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """This rank's index in its model-parallel group (every stage and model coordinate of its pipeline)."""
        return self.ds_model_group.index(self.global_rank)

    def get_model_parallel_world_size(self) -> int:
        """Stages x model coordinates."""
        return len(self.ds_model_group)

    def get_model_parallel_group(self):
        """The ranks of this rank's data coordinate (DeepSpeed's model-parallel group of a pipeline grid)."""
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """This rank's tensor-parallel coordinate (0 without a ``model`` axis)."""
        return self._topo.get_coord(self.global_rank).model if "model" in self._topo.axes else 0

    def get_slice_parallel_world_size(self) -> int:
        """The tensor-parallel degree (1 without a ``model`` axis)."""
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        """The tensor-parallel group; None when the degree is 1."""
        return self.slice_proc_group
