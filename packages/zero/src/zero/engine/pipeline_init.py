"""``initialize`` for a :class:`~zero_parallel.pipe.PipelineModule`: the stage's engine, ZeRO over the stage's
data-parallel group (DeepSpeed's ``initialize`` builds a ``PipelineEngine`` for such a model).

Checked before anything is built, on every rank (the config is the same everywhere): ZeRO stage 3 (DeepSpeed
refuses stages 2 and 3: "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"; here stage 2 shards each
stage's gradients over its data-parallel group and trains exactly as stage 1 does), an ``mpu`` (DeepSpeed asserts
it is None: the module's grid is the mpu), a ``tensor_parallel.autotp_size`` other than the topology's ``model``
axis, a schedule the module's virtual stages do not run, and fp16 (its loss scale is not carried through the
stages' gradients yet). With a ``model`` axis longer than 1 each stage's ``Linear`` layers are split over it by
zero_parallel's AutoTP before the optimizer is built (pipeline x tensor x data parallelism on one grid).
"""

from __future__ import annotations

import torch

from zero.config import ConfigError, NotSupportedError, load_config
from zero.engine.build_choice import build_engine_runtime
from zero.engine.data import build_dataloader
from zero.engine.pipeline import PipelineEngine, compile_refusal
from zero.engine.tensor_parallel import partition_of
from zero.optim import build_optimizer, build_scheduler
from zero.optim.adam import deepspeed_pick, record_pick
from zero.optim.trainable import left_out_names, split_trainable
from zero_comm import same_outcome
from zero_parallel import TensorParallelLayout, apply_autotp, resolve_specs
from zero_parallel.pipe import PipelineModule

_PIPELINE_KEYS = ("stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned",
                  "grad_partitioned", "use_reentrant", "schedule")  # fmt: skip
_SCHEDULES = ("1f1b", "eager_1f1b", "zero_bubble")


class StagesNormSplit:
    """zero_core's ``ModelParallel`` for the global gradient norm: every parameter of a stage is its own (summed
    over the stages of the pipeline, ``group``), as DeepSpeed's pipeline engine sums over its model-parallel
    group; a weight tied across stages is counted by the first stage holding it only (the others hold it equal),
    and with tensor parallelism inside the stages a replicated (unsplit) parameter by tensor-parallel rank 0 only.

    Args:
        group: the pipeline's model-parallel group.
        duplicates: ``id()`` of this stage's parameters another rank of ``group`` counts.
    """

    def __init__(self, group, duplicates: set[int]) -> None:
        self.group = group
        self.duplicates = duplicates

    def is_sharded(self, param: torch.nn.Parameter) -> bool:
        """True: no parameter is held whole by every stage."""
        return True

    def is_duplicate(self, param: torch.nn.Parameter) -> bool:
        """A tied weight an earlier stage holds and counts."""
        return id(param) in self.duplicates

    @classmethod
    def of(cls, model: PipelineModule, layout: TensorParallelLayout | None) -> StagesNormSplit:
        """The split for ``model``'s stage (``layout``: its AutoTP split, or None): its tied weights are
        duplicates unless this stage is the first of its tie's stages; with ``layout`` on tensor-parallel rank > 0,
        so are its unsplit parameters."""
        duplicates = {id(w) for w in model.tied_copies()}
        if layout is not None and layout.rank > 0:
            duplicates |= {id(p) for p in model.parameters() if not layout.is_sharded(p)}
        return cls(model.mpu().get_model_parallel_group(), duplicates)


def _split_stage(model: PipelineModule, cfg) -> TensorParallelLayout | None:
    """Split the stage's ``Linear`` layers over the topology's ``model`` axis with zero_parallel's AutoTP as the
    ``tensor_parallel`` section says (None without a model axis). Collective over the tensor-parallel ranks.

    Raises:
        ConfigError: ``tensor_parallel.autotp_size`` is not the model axis' length, or a partition spec that
            does not apply (from AutoTP).
    """
    size, tp = model.mpu().get_slice_parallel_world_size(), cfg.tensor_parallel.size
    if tp != size:
        raise ConfigError(f"config key 'tensor_parallel.autotp_size': {cfg.tensor_parallel.autotp_size} with a "
                          f"PipelineModule whose topology's 'model' axis is {size} long: make them equal "
                          "(PipeModelDataParallelTopology(num_mp=...) splits the stages over that many "
                          "ranks)")  # fmt: skip
    if size == 1:
        return None
    try:
        partition = resolve_specs(model, partition_of(cfg), cfg.tensor_parallel.preset_model)
        layout = apply_autotp(model, model.mpu().get_slice_parallel_group(), partition,
                              cfg.tensor_parallel.tp_overlap_comm)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"config key 'tensor_parallel': {e}") from None
    model.refresh_forward_funcs()
    return layout


def _pipeline_section(raw: dict) -> tuple[dict, dict]:
    """(the config without ``pipeline``, the ``pipeline`` section). Raises ConfigError for an unknown key."""
    section = raw.get("pipeline") or {}
    if not isinstance(section, dict):
        raise ConfigError(f"config key 'pipeline' must be a dict, got {type(section).__name__}")
    unknown = sorted(set(section) - set(_PIPELINE_KEYS))
    if unknown:
        raise ConfigError(f"config key 'pipeline.{unknown[0]}' is not a pipeline key (one of {list(_PIPELINE_KEYS)})")
    if section.get("schedule", "1f1b") not in _SCHEDULES:
        raise ConfigError(f"config key 'pipeline.schedule': {section['schedule']!r} is not one of {list(_SCHEDULES)} "
                          "(virtual_stages > 1 on the PipelineModule selects the interleaved 1F1B)")  # fmt: skip
    return {k: v for k, v in raw.items() if k != "pipeline"}, section


def _check(model: PipelineModule, cfg, mpu, schedule: str) -> None:
    stage = cfg.zero_optimization.stage
    if stage >= 3:
        raise NotSupportedError(f"config key 'zero_optimization.stage': {stage} with a PipelineModule; ZeRO-3 is "
                                "incompatible with pipeline parallelism (as in DeepSpeed): each stage holds its own "
                                "layers whole; use stage 0, 1 or 2")  # fmt: skip
    if mpu is not None:
        raise ValueError("initialize(mpu=...): must be None with a PipelineModule (its grid is the mpu)")
    if cfg.fp16.enabled:
        raise NotSupportedError("config key 'fp16.enabled': true with a PipelineModule is not supported yet (the "
                                "loss scale is not carried through the stages' gradients); use bf16 or "
                                "fp32")  # fmt: skip
    if cfg.torch_compile.enabled:
        refusal = compile_refusal(schedule, model.mpu().get_slice_parallel_world_size())
        if refusal is not None:
            raise NotSupportedError(f"config key 'torch_compile.enabled': true {refusal}")
    if model.virtual_stages > 1:
        if schedule != "1f1b":
            raise NotSupportedError(f"config key 'pipeline.schedule': {schedule!r} with virtual_stages="
                                    f"{model.virtual_stages}: virtual stages run the interleaved 1F1B only; use "
                                    f"virtual_stages=1 for the {schedule!r} schedule")  # fmt: skip
        if cfg.batch.gradient_accumulation_steps % model.num_stages:
            raise ConfigError(f"config key 'gradient_accumulation_steps': {cfg.batch.gradient_accumulation_steps} "
                              f"must be a multiple of the {model.num_stages} stages for the interleaved schedule "
                              f"(virtual_stages={model.virtual_stages})")  # fmt: skip
        if torch.distributed.get_backend(model.mpu().get_pipe_parallel_group()) != "gloo":
            raise NotSupportedError("PipelineModule(virtual_stages > 1): the interleaved schedule matches its "
                                    "transfers by tag, which only gloo honours; use virtual_stages=1 here")  # fmt: skip


def _repeating(loader):
    """Iterate ``loader`` forever, a new sampler epoch each pass (DeepSpeed's ``RepeatingLoader``)."""
    epoch = 0
    while True:
        yield from loader
        epoch += 1
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)


def initialize_pipeline(model: PipelineModule, raw, auto: dict, optimizer=None, model_parameters=None,
                        training_data=None, lr_scheduler=None, mpu=None, collate_fn=None):  # fmt: skip
    """The pipeline engine for ``model`` (called by ``zero.initialize``; arguments as there, ``raw`` the config).

    The batch triple counts the data-parallel replicas (``train_batch_size = micro x gas x dp``); a
    ``pipeline.activation_checkpoint_interval`` above 0 is set on the module (DeepSpeed's); ``pipeline.schedule``
    (zero's) is ``"1f1b"`` (DeepSpeed's, the default), ``"eager_1f1b"`` (1F1B with a longer warm-up and
    activations sent as each forward ends) or ``"zero_bubble"`` (ZB-H1).

    Returns:
        ``(engine, optimizer, training_dataloader or None, lr_scheduler or None)``.

    Raises:
        ConfigError / NotSupportedError naming the key, ValueError for an ``mpu`` (see the module notes), on every
        rank.
    """
    grid = model.mpu()
    with same_outcome("initialize"):
        if isinstance(raw, str):
            import json

            with open(raw) as f:
                raw = json.load(f)
        raw, section = _pipeline_section(dict(raw))
        # the batch counts the data-parallel replicas; a tensor-parallel split divides the world given here
        cfg = load_config(raw, grid.get_data_parallel_world_size() * grid.get_slice_parallel_world_size(), auto)
        schedule = section.get("schedule", "1f1b")
        _check(model, cfg, mpu, schedule)
        layout = _split_stage(model, cfg)
        interval = section.get("activation_checkpoint_interval", 0)
        if interval:
            model.set_checkpoint_interval(interval)
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        cfg._client_optimizer = optimizer is not None
        left_out: list[torch.Tensor] = []
        if optimizer is None and cfg.optimizer is not None:
            params, left_out = split_trainable(params)  # DeepSpeed's ZeRO holds no frozen parameter
            optimizer = build_optimizer(cfg.optimizer, params, model)
            record_pick(optimizer, deepspeed_pick(cfg))
        elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            optimizer = optimizer(params)
        if optimizer is None:
            raise ValueError("initialize(): a PipelineModule needs an optimizer (pass one or add an 'optimizer' "
                             "section): its engine trains with train_batch()")  # fmt: skip
    built = build_engine_runtime(model, optimizer, cfg, grid.get_data_parallel_group(),
                                 model_parallel=StagesNormSplit.of(model, layout))  # fmt: skip
    runtime = built.runtime
    if cfg.scheduler is not None:
        lr_scheduler = build_scheduler(cfg.scheduler, runtime.optimizer)
    elif lr_scheduler is not None and callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(runtime.optimizer)
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, cfg.batch.micro_batch_per_gpu, grid.get_data_parallel_rank(),
                                  grid.get_data_parallel_world_size(), collate_fn)  # fmt: skip
    engine = PipelineEngine(built, cfg, lr_scheduler=lr_scheduler, schedule=schedule,
                            frozen_left_out=left_out_names(model, left_out))  # fmt: skip
    if loader is not None:
        engine.set_dataiterator(_repeating(loader))
        engine.training_dataloader = loader
    return engine, runtime.optimizer, loader, lr_scheduler
