"""``zero.initialize``: DeepSpeed's entry point, returning ``(engine, optimizer, dataloader, lr_scheduler)``."""

from __future__ import annotations

import dataclasses
import warnings

import pydantic
import torch

from zero import parallel_groups as groups
from zero.config import ConfigError, load_config
from zero.distributed import init_distributed, rank_world
from zero.engine import Engine
from zero.engine.autoep import apply_autoep, check_autoep
from zero.engine.build_choice import build_engine_runtime
from zero.engine.compiled import check_autosp
from zero.engine.data import build_dataloader
from zero.engine.expert_checkpoints import ExpertParallelCheckpoints
from zero.engine.expert_parallel import moe_layers, setup_expert_parallel
from zero.engine.hybrid import HybridEngine
from zero.engine.pipeline_init import initialize_pipeline
from zero.engine.quantization import apply_quantization
from zero.engine.sequence_parallel import check_mpu_methods, parallel_groups
from zero.engine.tensor_parallel import merge_recorded, setup_tensor_parallel
from zero.kernels import register_quantizer_kernels
from zero.log import logger, set_level
from zero.optim import build_optimizer, build_scheduler
from zero.optim.adam import deepspeed_pick, record_pick
from zero.optim.trainable import left_out_names, split_trainable
from zero_comm import same_outcome
from zero_core import ZeroRuntime
from zero_parallel.moe import configure_moe_param_groups
from zero_parallel.pipe import PipelineModule


def _model_auto_values(model: torch.nn.Module) -> dict[str, object]:
    """Values for "auto" bucket keys from the model's hidden size, as Hugging Face's DeepSpeed integration fills."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if not isinstance(hidden, int):
        return {}
    return {"zero_optimization.reduce_bucket_size": hidden * hidden,
            "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "zero_optimization.stage3_param_persistence_threshold": 10 * hidden}  # fmt: skip


def _zenflow_steps_per_epoch(cfg, loader) -> None:
    """DeepSpeed fills ``zenflow.steps_per_epoch`` from the training dataloader when columns are re-selected per
    epoch (``select_strategy`` "epoch" or "auto"), over any value set; here in optimizer steps (the loader's
    micro-batches / ``gradient_accumulation_steps``, at least 1).

    Raises:
        ConfigError: the epoch makes ``select_interval`` shorter than ``update_interval``.
    """
    zen = cfg.zero_optimization.zenflow
    if zen is None or loader is None or zen.select_strategy == "step":
        return
    steps = max(1, len(loader) // cfg.batch.gradient_accumulation_steps)
    try:
        cfg.zero_optimization.zenflow = type(zen).model_validate({**zen.model_dump(), "steps_per_epoch": steps})
    except pydantic.ValidationError as e:
        raise ConfigError(f"zero_optimization.zenflow: with steps_per_epoch {steps} (the training dataloader's "
                          f"length in optimizer steps): {e.errors()[0]['msg']}") from e  # fmt: skip


def _launch_auto_values(rank: int, world: int) -> dict[str, object]:
    """``zero_hpz_partition_size: "auto"`` = ranks per node of this launch (torchrun's ``LOCAL_WORLD_SIZE``), so
    hpZ's secondary all-gather stays inside a node, which is what hpZ is for (ZeRO++ paper, section 3.2). Nothing
    when the environment does not describe a launch consistent with the process group ("auto" is then an error)."""
    import os

    from zero_comm.topology import launch_topology

    try:
        topo = launch_topology({**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world)})
    except ValueError:
        return {}
    return {"zero_optimization.zero_hpz_partition_size": topo.local_world_size}


def _config_from(args, config, config_params):
    if config is not None and config_params is not None:
        raise ConfigError("initialize(): give the config once, as 'config' (config_params is its old name)")
    config = config if config is not None else config_params
    if args is not None and getattr(args, "deepscale_config", None) is not None:  # DeepSpeed's deprecated spelling
        if getattr(args, "deepspeed_config", None) is not None:
            raise ConfigError("initialize(): args has both deepscale_config (deprecated) and deepspeed_config; keep "
                              "deepspeed_config")  # fmt: skip
        warnings.warn("args.deepscale_config is deprecated; use args.deepspeed_config", DeprecationWarning,
                      stacklevel=3)  # fmt: skip
        args.deepspeed_config, args.deepscale_config = args.deepscale_config, None
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "zero_config", None)
    if config is None:
        raise ConfigError("initialize(): no config given (pass config=dict or a JSON path, or args.deepspeed_config)")
    return config


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None, dist_init_required=None,
               collate_fn=None, config=None, config_params=None, auto_values: dict | None = None):  # fmt: skip
    """Wrap ``model`` for ZeRO training as ``deepspeed.initialize`` does.

    Args:
        args: an argparse namespace; ``args.deepspeed_config`` is read when ``config`` is None (the deprecated
            ``args.deepscale_config`` too, with a DeprecationWarning; both set: ConfigError).
        model: the ``torch.nn.Module`` to train (required).
        optimizer: a ``torch.optim.Optimizer``, or a callable ``params -> Optimizer``; None to build it from the
            config's `optimizer` section. Given both, the passed one is used (DeepSpeed's choice, with a
            warning here). With neither, the engine runs forward only
            (DeepSpeed's ZeRO-Inference, what TRL's reference and teacher models and transformers'
            ``evaluate()`` without training use): at stage 3 the parameters stay partitioned and are gathered per
            unit in forward (``offload_param`` honoured), at stages 0-2 each rank holds the whole model; no
            gradient buffer, master copy or optimizer state exists, the returned optimizer and scheduler are None
            (a `scheduler` section is ignored, as DeepSpeed does), and ``backward``/``step`` raise RuntimeError.
        model_parameters: the parameters (or param-group dicts) to optimize; default: ``model.parameters()``.
        training_data: a ``torch.utils.data.Dataset``; returns a DistributedSampler loader of micro-batches.
        lr_scheduler: a scheduler or a callable ``optimizer -> scheduler``; the config's `scheduler` wins.
        config: a dict or a JSON path (DeepSpeed's format); ``config_params`` is its older name.
        auto_values: values for ``"auto"`` keys (dotted names); bucket sizes are also filled from ``model.config``.
        distributed_port: the rendezvous port used when torchrun's RANK/WORLD_SIZE are set but MASTER_PORT is not
            (DeepSpeed's default 29500); ignored when MASTER_PORT is set or a process group exists.
        dist_init_required: None or True: create the process group if none exists (DeepSpeed's behaviour);
            False: never create one, and raise ValueError when none exists.
        mpu: None, or DeepSpeed's sequence-parallel mpu (what ``UlyssesSPAttentionHF.register_with_transformers``
            returns; the methods of :class:`zero.engine.sequence_parallel.SequenceParallelMPU`). As DeepSpeed does,
            ZeRO then partitions and averages gradients over ``mpu.get_sequence_data_parallel_group()`` (sp x dp),
            the batch triple and the training loader count the data-parallel ranks only
            (``train_batch_size = micro x gas x mpu.get_data_parallel_world_size()``), the config's
            ``sequence_parallel_size`` (when given) must equal ``mpu.get_sequence_parallel_world_size()``, and
            ``deepspeed.utils.groups`` answers from the mpu until the engine's ``destroy()``.

    With a `quantization` section enabled, the selected ``nn.Linear`` layers are replaced in ``model`` by
    ``zero_kernels.SubchannelLinear`` layers holding the same parameters (``zero.engine.quantization``).

    With ``tensor_parallel.autotp_size`` > 1 (or a ``tp_model_init`` record for ``model``) the model is split by
    AutoTP first (``zero.engine.tensor_parallel``): ZeRO then partitions and averages over the data-parallel ranks
    of each tensor-parallel rank, the batch triple and loader count world / autotp_size ranks, and the gradient
    norm counts each split parameter's shards once and each replicated parameter once. Ranks of one
    tensor-parallel group must be given the same batches.

    A :class:`~zero_parallel.pipe.PipelineModule` (``deepspeed.pipe``) gets a
    :class:`~zero.engine.pipeline.PipelineEngine` for this rank's stage, ZeRO over the stage's data-parallel
    replicas (``zero.engine.pipeline_init``).

    Returns:
        ``(engine, optimizer, training_dataloader or None, lr_scheduler or None)``.

    Raises:
        ConfigError / NotSupportedError naming the key; ValueError for a missing model; TypeError naming the
        methods an ``mpu`` lacks (a Megatron model-parallel mpu: tensor/pipeline parallelism are not implemented).
    """
    if model is None:
        raise ValueError("initialize(): 'model' is required (a torch.nn.Module)")
    if mpu is not None:
        check_mpu_methods(mpu)
    raw = _config_from(args, config, config_params)
    if dist_init_required is False and not torch.distributed.is_initialized():
        raise ValueError("initialize(dist_init_required=False): no process group exists; create one first "
                         "(zero.init_distributed()) or leave dist_init_required as None")  # fmt: skip
    init_distributed(distributed_port=distributed_port)  # a no-op when a group exists
    rank, world = rank_world()
    if isinstance(model, PipelineModule):  # DeepSpeed's PipelineEngine: this rank's stage, ZeRO over its replicas
        auto = {**_launch_auto_values(rank, world), **(auto_values or {})}
        return initialize_pipeline(model, raw, auto, optimizer, model_parameters, training_data, lr_scheduler, mpu,
                                   collate_fn)  # fmt: skip
    with same_outcome("initialize"):  # a config or optimizer error on one rank is raised on every rank
        auto = {**_model_auto_values(model), **_launch_auto_values(rank, world), **(auto_values or {})}
        raw = merge_recorded(model, raw)  # what tp_model_init recorded for this model
        cfg = load_config(raw, world if mpu is None else mpu.get_data_parallel_world_size(), auto)
        topo = parallel_groups(mpu, cfg.sequence_parallel_size)
        check_autosp(cfg, mpu)  # compile.passes ["autosp"]: the mpu's group, no eager adapter as well
        check_autoep(cfg, world)  # AutoEP's sizes (folded with AutoTP's) before AutoTP splits the model
        tp = setup_tensor_parallel(model, cfg, mpu)  # AutoTP splits the model; ZeRO then runs over dp only
        if tp is not None:
            topo = tp.groups
        # `expert_parallel` (AutoEP): the MoE blocks replaced by expert-parallel ones holding this rank's experts
        optimizer, model_parameters = apply_autoep(model, cfg, world, optimizer, model_parameters,
                                                   tp.layout.group if tp is not None else None)  # fmt: skip
        # `quantization`: the selected Linear layers swapped for quantized ones holding the same parameters
        model = apply_quantization(model, cfg.quantization)
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        left_out: list[torch.Tensor] = []
        cfg._client_optimizer = optimizer is not None  # DeepSpeed: a passed optimizer wins over the section
        if optimizer is not None and cfg.optimizer is not None:
            logger.warning("initialize(): an optimizer was passed, so the config's 'optimizer' section (%s) is not "
                           "used (DeepSpeed's choice)", cfg.optimizer.type)  # fmt: skip
        if optimizer is None:
            if cfg.optimizer is not None:
                params, left_out = split_trainable(params)  # DeepSpeed's ZeRO holds no frozen parameter
                if moe_layers(model):  # DeepSpeed's _configure_optimizer: expert parameters in groups of their own
                    params = configure_moe_param_groups(params)
                optimizer = build_optimizer(cfg.optimizer, params, model)
                record_pick(optimizer, deepspeed_pick(cfg))  # isinstance checks against DeepSpeed's Adam classes
            # else forward only (DeepSpeed's ZeRO-Inference): a frozen reference, teacher or evaluation model
        elif not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            optimizer = optimizer(params)
        # DeepSpeed MoE layers: their expert groups; with ep_size > 1 ZeRO runs over the expert-data-parallel group
        experts = setup_expert_parallel(model, cfg, mpu, tp)

    loader = None
    if training_data is not None:
        # ranks sharing a sequence read the same samples: the loader counts data-parallel ranks (DeepSpeed's)
        loader = build_dataloader(training_data, cfg.batch.micro_batch_per_gpu, topo.data_parallel_rank,
                                  topo.data_parallel_size, collate_fn)  # fmt: skip
    _zenflow_steps_per_epoch(cfg, loader)
    if cfg.log_level is not None:  # DeepSpeed sets its logger's level (and its handlers') from the config
        set_level(cfg.log_level)
    if torch.cuda.is_available():  # ZeRO++'s quantized collectives may then use the CUDA quantize kernel
        register_quantizer_kernels()
    # zero_core's, or the 1-bit optimizers' stage 0; over sp x dp with a sequence-parallel mpu (DeepSpeed's choice)
    split = tp.layout if experts is None and tp is not None else experts  # AutoEP folded on AutoTP: experts' object
    built = build_engine_runtime(model, optimizer, cfg, topo.shard_group if experts is None else experts.edp_group,
                                 model_parallel=split)  # fmt: skip
    if experts is not None and isinstance(built.runtime, ZeroRuntime):  # shared groups averaged after reduction
        experts.attach(built.runtime)
    if moe_layers(model):  # one checkpoint per expert-parallel rank, loadable at any ep_size
        ep_size, ep_rank = (1, 0) if experts is None else (experts.ep_size, experts.ep_rank)
        parts = ExpertParallelCheckpoints(built.runtime, ep_size, ep_rank, cfg.checkpoint.format,
                                          tp.layout if tp is not None and experts is not None else None,
                                          None if experts is None else experts.group)  # fmt: skip
        built = dataclasses.replace(built, checkpoints=parts)
    runtime = built.runtime
    if mpu is not None:
        groups.mpu = mpu  # deepspeed.utils.groups answers from it (the HF Trainer's sequence-parallel loss asks)
    if tp is not None:
        groups.tensor_parallel = tp.mesh_groups  # its tensor-parallel getters answer for the AutoTP mesh
    if runtime.optimizer is None:  # forward only: nothing to schedule (DeepSpeed ignores the section too)
        lr_scheduler = None
    elif cfg.scheduler is not None:
        lr_scheduler = build_scheduler(cfg.scheduler, runtime.optimizer)
    elif lr_scheduler is not None and callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(runtime.optimizer)
    kind = HybridEngine if cfg.hybrid_engine.enabled else Engine  # DeepSpeed's DeepSpeedHybridEngine switch
    engine = kind(built, cfg, lr_scheduler=lr_scheduler, training_dataloader=loader, mpu=mpu,
                  tp_groups=tp.mesh_groups if tp is not None else None,
                  frozen_left_out=left_out_names(model, left_out))  # fmt: skip
    return engine, runtime.optimizer, loader, lr_scheduler
