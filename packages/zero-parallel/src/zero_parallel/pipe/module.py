"""DeepSpeed's ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``deepspeed.pipe``): a model written as a
list of layers, cut into stages, each rank building and running only its stage's layers.

Mirrored from DeepSpeed 0.19.8: the partition methods (``"parameters"``: balance trainable parameter counts, built
one LayerSpec at a time; ``"uniform"``: balance layer counts; ``"type:REGEX"``: balance the layers whose class name
matches REGEX, case-insensitive), the forward (each layer's output is the next layer's input; a tuple is passed as
one argument), ``seed_layers`` (layer ``i`` built under seed ``base_seed + i``), activation checkpointing every
``activation_checkpoint_interval`` layers, and tied layers (one module per key on each stage using it, its tied
weights broadcast from the first such stage at build and their gradients summed over those stages).
Differences: a partition leaving a stage without layers, or ``num_stages`` not dividing the world size, raises
ValueError on every rank (DeepSpeed builds an empty stage, or raises RuntimeError for the latter); the default
checkpoint function is ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from zero_parallel.pipe.partition import partition_balanced, partition_uniform
from zero_parallel.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


class PipelineError(Exception):
    """A pipeline module or engine used outside what it supports (DeepSpeed's ``PipelineError``)."""


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``, built only on the stage that owns it.

    Raises (``__init__``): TypeError when ``typename`` is not an ``nn.Module`` subclass (DeepSpeed: RuntimeError).
    """

    def __init__(self, typename: type, *module_args, **module_kwargs) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be a torch.nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """A new module from the stored arguments (``log`` is accepted for DeepSpeed's signature)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every ``TiedLayerSpec`` of the same ``key`` (an embedding and the LM head).

    Args:
        key: the tie's name; the first spec of a key on a stage builds the module, later ones reuse it.
        typename, module_args, module_kwargs: as :class:`LayerSpec`.
        forward_fn: None: call the module; else ``forward_fn(module, inputs)`` (e.g. a head using the embedding's
            weight).
        tied_weight_attr: the attribute path(s) of the tied parameters in the module (``"weight"``,
            ``"embed.weight"``), a str or a list.
    """

    def __init__(self, key: str, typename: type, *module_args, forward_fn: Callable | None = None,
                 tied_weight_attr: str | list[str] = "weight", **module_kwargs) -> None:  # fmt: skip
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators, as DeepSpeed's ``set_random_seed``."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:  # numpy is optional here
        numpy = None
    if numpy is not None:
        numpy.random.seed(seed % (2**32))
    torch.manual_seed(seed % (2**63))


def _checkpoint(function, *args):
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _layer_name(layer) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class PipelineModule(nn.Module):
    """The stage of a layer-list model that this rank runs (DeepSpeed's ``PipelineModule``).

    Args:
        layers: the layers in order: ``nn.Module`` instances, :class:`LayerSpec` / :class:`TiedLayerSpec`, or
            callables without parameters.
        num_stages: the pipeline degree (must divide the world size; data parallel over the rest); or None with
            ``topology``.
        topology: a :class:`~zero_parallel.pipe.topology.ProcessTopology` with ``pipe`` and ``data`` axes.
        loss_fn: ``loss_fn(outputs, labels) -> scalar tensor`` run on the last stage; None: the last layer's output
            is the loss.
        seed_layers, seed_fn, base_seed: build layer ``i`` after ``seed_fn(base_seed + i)`` (default
            :func:`set_random_seed`), and reseed before each layer's forward as DeepSpeed does.
        partition_method: ``"parameters"``, ``"uniform"`` or ``"type:REGEX"`` (case-insensitive).
        activation_checkpoint_interval: checkpoint every this many layers (0: none).
        activation_checkpoint_func: ``func(function, *inputs)``; default: torch's non-reentrant checkpoint.
        checkpointable_layers: class names of layers that may be checkpointed; None: any chunk with parameters.
        dynamic_shape: accepted for DeepSpeed's signature (shapes are sent with every batch here).
        virtual_stages: model chunks per stage (zero's addition, for the interleaved schedule): the layers are cut
            into ``num_stages * virtual_stages`` parts and stage ``s`` holds parts ``s, s + num_stages, ...``;
            ``forward(x, chunk=c)`` runs chunk ``c``. 1: DeepSpeed's layout.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: neither num_stages nor topology; num_stages not dividing the world size; an unknown partition
            method; a ``type:`` regex matching no layer; a partition leaving a stage without layers (all raised on
            every rank, before any group is created).
    """

    def __init__(self, layers, num_stages: int | None = None, topology: ProcessTopology | None = None,
                 loss_fn: Callable | None = None, seed_layers: bool = False, seed_fn: Callable | None = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = _checkpoint, checkpointable_layers: list[str] | None = None,
                 dynamic_shape: bool = False, virtual_stages: int = 1) -> None:  # fmt: skip
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("PipelineModule needs torch.distributed initialized (deepspeed.init_distributed())")
        if num_stages is None and topology is None:
            raise ValueError("PipelineModule: give num_stages or topology")
        world = dist.get_world_size()
        if topology is None:
            if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
                raise ValueError(f"PipelineModule: num_stages must be an int >= 1, got {num_stages!r}")
            if world % num_stages:
                raise ValueError(f"PipelineModule: num_stages={num_stages} does not divide the world size {world}: "
                                 "the ranks are laid out as stages x data-parallel replicas")  # fmt: skip
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"PipelineModule: virtual_stages must be an int >= 1, got {virtual_stages!r}")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(f"PipelineModule: checkpointable_layers must be a list, got {checkpointable_layers!r}")
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.seed_fn = seed_fn
        self.base_seed = base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0  # forwards run so far (DeepSpeed's per-layer reseeding in forward uses it)
        self.curr_layer = 0  # the global index of the layer running in forward
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        self.virtual_stages = virtual_stages
        self._layer_specs = list(layers)
        self._num_layers = len(self._layer_specs)
        self.global_rank = dist.get_rank()
        self.world_size = world
        self.parts = self._partition(partition_method)  # virtual stage v holds layers parts[v]:parts[v + 1]
        self._grid = PipelineParallelGrid(topology)
        self.stage_id = self._grid.stage_id
        # chunk c of this stage is virtual stage c * num_stages + stage_id: layers parts[v]:parts[v + 1]
        virtuals = range(self.stage_id, self.num_stages * virtual_stages, self.num_stages)
        self._chunk_layers = [(self.parts[v], self.parts[v + 1]) for v in virtuals]
        self._local_start, self._local_stop = self._chunk_layers[0]
        self.forward_funcs: list[Callable] = []  # the local layers' callables, in order (chunk after chunk)
        self._func_layers: list[int] = []  # the global layer index of each forward_funcs entry
        self._chunk_funcs: list[tuple[int, int]] = []  # each chunk's range in forward_funcs
        self.fwd_map: dict[str, int] = {}  # submodule name -> index in forward_funcs
        self._tied_funcs: list[tuple[int, str, Callable | None]] = []  # (index in forward_funcs, key, forward_fn)
        self.tied_modules = nn.ModuleDict()  # key -> the module shared by this stage's TiedLayerSpecs of key
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.layers_compiled = False  # compile() ran: forward_funcs call the compiled layers
        self._build()
        self.tied_comms = self._index_tied_modules()  # key -> {"ranks", "group", "weight_attr", "module"}
        self._synchronize_tied_weights()

    # --- partitioning -------------------------------------------------------------------------------------------
    def _partition(self, method: str) -> list[int]:
        if not isinstance(method, str):
            raise ValueError(f"PipelineModule: partition_method must be a str, got {method!r}")
        low = method.lower()
        count = self.num_stages * self.virtual_stages
        if low == "uniform":
            parts = partition_uniform(self._num_layers, count)
        elif low == "parameters":
            parts = partition_balanced(self._layer_param_counts(), count)
        elif low.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            hits = [int(n is not None and bool(pattern.search(n))) for n in map(_layer_name, self._layer_specs)]
            if not any(hits):
                raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer class name")
            parts = partition_balanced(hits, count)
        else:
            raise ValueError(f"PipelineModule: partition_method {method!r} is not one of 'parameters', 'uniform', "
                             "'type:REGEX'")  # fmt: skip
        empty = [s for s in range(count) if parts[s] == parts[s + 1]]
        if empty:
            what = "stage(s)" if self.virtual_stages == 1 else "virtual stage(s)"
            raise ValueError(f"PipelineModule: partition_method {method!r} leaves {what} {empty} without layers "
                             f"(boundaries {parts} for {self._num_layers} layers over {count} {what[:-3]}s); "
                             "give at least one layer per stage")  # fmt: skip
        return parts

    def _layer_param_counts(self) -> list[int]:
        """Trainable parameters per layer; a LayerSpec is built to count it (DeepSpeed's ``_count_layer_params``)."""
        counts = []
        for layer in self._layer_specs:
            if isinstance(layer, LayerSpec):
                counts.append(_trainable_count(layer.build()))
            elif isinstance(layer, nn.Module):
                counts.append(_trainable_count(layer))
            else:
                counts.append(0)
        return counts

    def partitions(self) -> list[int]:
        """The stage boundaries: (virtual) stage ``s`` holds layers ``parts[s]:parts[s + 1]``."""
        return self.parts

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding layer ``layer_idx``. Raises ValueError for an index out of range."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"stage_owner: layer index {layer_idx} is outside 0..{self._num_layers - 1}")
        virtual = next(v for v in range(len(self.parts) - 1) if self.parts[v] <= layer_idx < self.parts[v + 1])
        return virtual % self.num_stages

    def topology(self) -> ProcessTopology:
        """The process topology."""
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        """The grid of process groups (DeepSpeed hands it to the engine as its ``mpu``)."""
        return self._grid

    # --- building -----------------------------------------------------------------------------------------------
    def _seed(self, seed: int) -> None:
        (self.seed_fn or set_random_seed)(seed)

    def _build(self) -> None:
        for start, stop in self._chunk_layers:
            first = len(self.forward_funcs)
            for idx in range(start, stop):
                self._build_layer(idx)
                self._func_layers.append(idx)
            self._chunk_funcs.append((first, len(self.forward_funcs)))

    def _build_layer(self, idx: int) -> None:
        """Build layer ``idx`` (or reuse its tie's module) into ``forward_funcs``."""
        layer = self._layer_specs[idx]
        if self.seed_layers:
            self._seed(self.base_seed + idx)
        if isinstance(layer, PipelineModule):
            raise TypeError(f"PipelineModule: layer {idx} is itself a PipelineModule; nest its layers instead")
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            self._tied_funcs.append((len(self.forward_funcs), layer.key, layer.forward_fn))
            self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
        elif isinstance(layer, nn.Module | LayerSpec):
            module = layer if isinstance(layer, nn.Module) else layer.build()
            self.forward_funcs.append(module)
            self.fwd_map[str(idx)] = len(self.forward_funcs) - 1
            self.add_module(str(idx), module)
        elif callable(layer):
            self.forward_funcs.append(layer)
        else:
            raise TypeError(f"PipelineModule: layer {idx} must be an nn.Module, LayerSpec or callable, got "
                            f"{type(layer).__name__}")  # fmt: skip

    def _index_tied_modules(self) -> dict[str, dict]:
        """Create, for each tie key held by several stages, one group per (data, model) coordinate over those
        stages' ranks (collective: every rank creates every group in the same order)."""
        comms: dict[str, dict] = {}
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        grid, me = self._grid, self.global_rank
        for key in keys:
            owners = sorted({self.stage_owner(i) for i, s in enumerate(self._layer_specs)
                             if isinstance(s, TiedLayerSpec) and s.key == key})  # fmt: skip
            if len(owners) < 2:
                continue
            models = range(grid.model_parallel_size)
            for data in range(grid.data_parallel_size):
                for model in models:
                    extra = {"model": model} if "model" in self._topo.axes else {}
                    ranks = [self._topo.get_rank(pipe=s, data=data, **extra) for s in owners]
                    group = dist.new_group(ranks=ranks)
                    if me in ranks:
                        comms[key] = {"ranks": ranks, "group": group, "weight_attr": self.tied_weight_attrs[key],
                                      "module": self.tied_modules[key]}  # fmt: skip
        return comms

    @staticmethod
    def _recursive_getattr(module: nn.Module, attr_name: str) -> torch.Tensor:
        for part in attr_name.split("."):
            module = getattr(module, part)
        return module

    def tied_weights(self) -> list[tuple[torch.Tensor, object]]:
        """This stage's tied parameters held by several stages, each with the group of the stages holding it."""
        return [(self._recursive_getattr(c["module"], attr), c["group"])
                for c in self.tied_comms.values() for attr in c["weight_attr"]]  # fmt: skip

    get_tied_weights_and_groups = tied_weights  # DeepSpeed's name

    def tied_copies(self) -> list[torch.Tensor]:
        """This stage's tied weights that an earlier stage holds too (equal after each step: a global gradient
        norm counts them on the first stage only)."""
        me = dist.get_rank()
        return [self._recursive_getattr(c["module"], attr) for c in self.tied_comms.values()
                if me != min(c["ranks"]) for attr in c["weight_attr"]]  # fmt: skip

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum each tied weight's ``.grad`` over the stages holding it (DeepSpeed's method, for plain ``.grad``)."""
        for weight, group in self.tied_weights():
            dist.all_reduce(weight.grad, group=group)

    def _synchronize_tied_weights(self) -> None:
        for c in self.tied_comms.values():
            for attr in c["weight_attr"]:
                weight = self._recursive_getattr(c["module"], attr)
                dist.broadcast(weight.data, src=min(c["ranks"]), group=c["group"])

    def refresh_forward_funcs(self) -> None:
        """Call the stage's current submodules in forward after some were replaced in place (AutoTP swapping a
        ``Linear`` for its tensor-parallel split): ``forward_funcs`` holds the modules as built."""
        for name, i in self.fwd_map.items():
            self.forward_funcs[i] = self.get_submodule(name)
        for i, key, forward_fn in self._tied_funcs:
            module = self.tied_modules[key]
            self.forward_funcs[i] = module if forward_fn is None else partial(forward_fn, module)

    def compile(self, *args, **kwargs) -> None:
        """``torch.compile`` each of the stage's layers (DeepSpeed's ``PipelineModule.compile``): a module layer in
        place (``nn.Module.compile(*args, **kwargs)``), any other callable (a tied layer's ``forward_fn`` bound to
        its module, a parameterless function) replaced in ``forward_funcs`` by ``torch.compile(callable, *args,
        **kwargs)``. :meth:`forward` stays eager around the layers, so per-layer reseeding, activation checkpointing
        (its recomputation runs the compiled layers again) and the chunks of virtual stages run as without
        compilation; autograd crosses the layers as usual. A second call does nothing (DeepSpeed's recompiles).
        Compilation happens at each layer's first call; :meth:`refresh_forward_funcs` after this call would drop
        the compiled callables."""
        if self.layers_compiled:
            return
        for i, func in enumerate(self.forward_funcs):
            if isinstance(func, nn.Module):
                func.compile(*args, **kwargs)
            else:
                self.forward_funcs[i] = torch.compile(func, *args, **kwargs)
        self.layers_compiled = True

    # --- forward ------------------------------------------------------------------------------------------------
    def _run_range(self, start: int, end: int) -> Callable:
        offset = self.micro_offset + 1

        def run(*inputs):
            x = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:end]):
                self.curr_layer = self._func_layers[start + i]
                if self.seed_layers:
                    self._seed(self.base_seed * offset + self.curr_layer)
                x = layer(x)
            return x

        return run

    def _checkpointable(self, funcs: list) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(any(True for _ in f.parameters()) for f in funcs if isinstance(f, nn.Module))

    def forward(self, forward_input, chunk: int = 0):
        """Run this stage's layers (of model chunk ``chunk`` with ``virtual_stages`` > 1) on ``forward_input`` (a
        tensor or a tuple of tensors); returns the last one's output. With ``activation_checkpoint_interval`` > 0
        each run of that many layers that has parameters (or whose layers are all ``checkpointable_layers``) runs
        under ``activation_checkpoint_func``.

        Raises: ValueError for a chunk outside ``0 .. virtual_stages - 1``."""
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"PipelineModule.forward: chunk must be in 0..{self.virtual_stages - 1}, got {chunk}")
        self.micro_offset += 1
        interval = self.activation_checkpoint_interval
        first, count = self._chunk_funcs[chunk]
        if interval == 0:
            return self._run_range(first, count)(forward_input)
        x = forward_input
        for start in range(first, count, interval):
            end = min(start + interval, count)
            args = x if isinstance(x, tuple) else (x,)
            run = self._run_range(start, end)
            x = self.activation_checkpoint_func(run, *args) if self._checkpointable(self.forward_funcs[start:end]) \
                else run(*args)  # fmt: skip
        return x

    def set_checkpoint_interval(self, interval: int) -> None:
        """Change ``activation_checkpoint_interval``. Raises ValueError for a negative interval."""
        if interval < 0:
            raise ValueError(f"set_checkpoint_interval: interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    def get_additional_losses(self):
        """Extra losses to report beside the loss (DeepSpeed's hook); None here."""
        return None
