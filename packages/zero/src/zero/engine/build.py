"""Build zero_core's ZeroRuntime for a config: precision policy, loss scaler, clipping."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero.config import EngineConfig, NotSupportedError
from zero.config.offload_auto import describe_offload
from zero.engine.compiled import compiled_path
from zero.engine.precision import announce, cast_buffers, loss_scaler, precision_policy
from zero.engine.seams import SeamClaims
from zero_core import ZeroRuntime
from zero_offload import master_store_for, param_store_for

__all__ = ["build_runtime", "loss_scaler", "precision_policy"]


def build_runtime(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, cfg: EngineConfig, group=None,
                  model_parallel=None) -> tuple[ZeroRuntime, Callable | None]:  # fmt: skip
    """A ``zero_core.ZeroRuntime`` and DeepCompile's compiled forward (None without ``compile.deepcompile``),
    training ``model`` with ``optimizer`` as ``cfg`` says (stage, precision, clip,
    ``offload_optimizer`` through zero_offload's master store, ``offload_param`` through its parameter store).
    ``optimizer`` None: a forward-only runtime (no master store; DeepCompile is refused: NotSupportedError).
    ``model_parallel``: AutoTP's layout when the model is split (``group`` is then the data-parallel group)."""
    device_type = next(model.parameters()).device.type
    policy = precision_policy(cfg, device_type)
    rank = torch.distributed.get_rank(group) if torch.distributed.is_initialized() else 0
    announce(policy, device_type, rank)
    cast_buffers(model, cfg)  # data_types.buffer_dtype / keep_in_fp32_modules
    if optimizer is None and cfg.compile.deepcompile:
        raise NotSupportedError("config key 'compile.deepcompile': a model without an optimizer (forward only) runs "
                                "eagerly in zero; set it false for this model")  # fmt: skip
    path = compiled_path(cfg, rank)  # DeepCompile: the graphs gather and reduce, through the core's seam
    seams = SeamClaims()
    if path is not None:
        seams.claim("param_store", path.params, "compile.deepcompile")
        seams.claim("grad_reduction", path.grads, "compile.deepcompile")
        seams.claim("master_store", path.master, "compile.offload_opt_states")
    world = torch.distributed.get_world_size(group) if torch.distributed.is_initialized() else 1
    # offload_optimizer: masters and optimizer state in host memory / on NVMe (NVMe's path checked here, first)
    master = None
    if optimizer is not None:  # forward only: no master copy or optimizer state anywhere (offload_optimizer unused)
        master = master_store_for(cfg.zero_optimization, model, world, torch.distributed.get_rank() if
                                  torch.distributed.is_initialized() else 0, cfg.aio.settings())  # fmt: skip
    seams.claim("master_store", master, "zero_optimization.offload_optimizer")
    line = describe_offload(cfg)  # the offload sections as used, "auto" keys resolved
    if line and rank == 0:
        print(line, flush=True)
    params = param_store_for(cfg.zero_optimization, model, world, rank, cfg.aio.settings())  # offload_param
    seams.claim("param_store", params, "zero_optimization.offload_param")
    runtime = ZeroRuntime(model, optimizer, config=cfg.zero_optimization, precision=policy, group=group,
                          gradient_clipping=cfg.gradient_clipping, loss_scaler=loss_scaler(cfg),
                          model_parallel=model_parallel, **seams.stores)  # fmt: skip
    return runtime, (path.forward if path is not None else None)
