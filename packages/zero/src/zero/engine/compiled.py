"""The engine's compiled paths: DeepCompile (``compile.deepcompile``, zero_compile's passes joined to the core's
seam), autosp (``compile.passes: ["autosp"]``: Ulysses sequence parallelism in the graph over the eager engine),
autotp (``compile.passes: ["autotp"]``: AutoTP's collectives in the graph of the eagerly split model) and plain
``torch_compile`` of the module over the eager engine; :func:`torch_backend`, the backend plain compilation uses."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from zero.config import ConfigError, EngineConfig
from zero.engine.runtime_protocol import BuiltRuntime, EngineRuntime


def torch_backend(backend, module: torch.nn.Module, compile_kwargs: dict | None = None):
    """The backend the engine's plain ``torch.compile`` of ``module`` uses for the requested ``backend``: for
    "inductor" on a CPU model (its first parameter's device; no ``mode`` or ``options`` in ``compile_kwargs``,
    which torch.compile takes for its own inductor only) zero_compile's :class:`CpuAttentionBackend` (inductor,
    with bf16/fp16 attention calls moved to fp32 where that is faster on this CPU), else ``backend`` itself."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if backend != "inductor" or device.type != "cpu" or {"mode", "options"} & (compile_kwargs or {}).keys():
        return backend
    from zero_compile.cpu_backend import CpuAttentionBackend

    return CpuAttentionBackend("inductor")


def compiled_path(cfg: EngineConfig, rank: int):
    """A ``zero_compile.core.CompiledPath`` for ``ZeroRuntime(param_store=..., grad_reduction=...)`` when
    ``compile.deepcompile`` is true, else None. ``double_buffer`` false turns the prefetch pass off; ``debug_log``
    dumps each pass's graph under ``compile.debug_dir/rank<r>``; ``offload_opt_states`` gives the path a master
    store (``path.master``) keeping ``opt_states_budget_bytes`` of optimizer state on the device."""
    c = cfg.compile
    if not c.deepcompile or uses_autosp(cfg) or uses_autotp(cfg):
        return None
    from zero_compile.core import CompiledPath

    debug_dir = os.path.join(c.debug_dir, f"rank{rank}") if c.debug_log else None
    return CompiledPath(stage=cfg.zero_optimization.stage, backend=c.backend, warmup_steps=c.warmup_steps,
                        budget_bytes=c.memory_budget_bytes, prefetch=c.double_buffer, debug_dir=debug_dir,
                        offload_opt_states=c.offload_opt_states,
                        opt_states_budget_bytes=c.opt_states_budget_bytes)  # fmt: skip


def uses_autosp(cfg: EngineConfig) -> bool:
    """``compile.deepcompile`` with ``compile.passes: ["autosp"]``."""
    return cfg.compile.deepcompile and "autosp" in (cfg.compile.passes or ())


def uses_autotp(cfg: EngineConfig) -> bool:
    """``compile.deepcompile`` with ``compile.passes: ["autotp"]``."""
    return cfg.compile.deepcompile and "autotp" in (cfg.compile.passes or ())


def split_layers(module: torch.nn.Module) -> dict:
    """``id()`` of each weight AutoTP split in ``module`` -> its ``zero_compile.passes.autotp.SplitLinear``, after
    telling each split layer to leave its collectives to the graph (``collectives_in_graph``)."""
    from zero_compile.passes.autotp import SplitLinear
    from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

    layers = {}
    for name, layer in module.named_modules():
        if isinstance(layer, ColumnParallelLinear):
            layers[id(layer.weight)] = SplitLinear(name, "column", layer.widths if layer.gather_output else None)
        elif isinstance(layer, RowParallelLinear):
            layers[id(layer.weight)] = SplitLinear(name, "row")
        else:
            continue
        layer.collectives_in_graph = True
    return layers


def check_autosp(cfg: EngineConfig, mpu) -> None:
    """What the autosp pass needs beyond the config (checked by ``initialize`` before the runtime is built).

    Raises:
        ConfigError: ``compile.passes: ["autosp"]`` without a sequence-parallel ``mpu``; or with zero_parallel's
            eager Ulysses adapter registered in transformers' attention interface (attention would be exchanged
            twice: use one or the other).
    """
    if not uses_autosp(cfg):
        return
    if mpu is None:
        raise ConfigError("compile.passes ['autosp'] needs the sequence-parallel group: pass initialize(mpu="
                          "zero_parallel.SequenceParallelMPU.build(sequence_parallel_size))")  # fmt: skip
    from zero_parallel.ulysses import CORE_IMPLEMENTATIONS, UlyssesSPAttentionHF

    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # no transformers: no adapter can be registered
        return
    for key in CORE_IMPLEMENTATIONS:
        if isinstance(ALL_ATTENTION_FUNCTIONS.get(key), UlyssesSPAttentionHF):
            raise ConfigError(f"compile.passes ['autosp'] with the eager Ulysses adapter registered for {key!r}: "
                              "the pass inserts the same all-to-alls in the graph; build the mpu with "
                              "SequenceParallelMPU.build(n) instead of register_with_transformers, or call "
                              f"unregister_from_transformers({key!r})")  # fmt: skip


def forward_callable(built: BuiltRuntime, cfg: EngineConfig, mpu=None):
    """What ``Engine.forward`` calls: DeepCompile's compiled forward, the module compiled with the autosp pass over
    ``mpu``'s sequence-parallel group (``compile.passes: ["autosp"]``; ``compile.backend`` is the inner compiler,
    ``debug_log`` dumps the graph before and after the pass), the AutoTP-split module compiled with the autotp pass
    over its tensor-parallel group (``compile.passes: ["autotp"]``, the same keys), ``torch.compile(module)`` under
    ``torch_compile.enabled``, or the module itself."""
    module = built.runtime.module
    if uses_autosp(cfg):
        from zero_compile.sp_backend import compile_sequence_parallel

        c = cfg.compile
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        debug_dir = os.path.join(c.debug_dir, f"rank{rank}") if c.debug_log else None
        return compile_sequence_parallel(module, mpu.get_sequence_parallel_group(), inner=c.backend,
                                         debug_dir=debug_dir)  # fmt: skip
    if uses_autotp(cfg):
        from zero_compile.tp_backend import compile_tensor_parallel
        from zero_parallel import layout_of

        c = cfg.compile
        rank = torch.distributed.get_rank()
        debug_dir = os.path.join(c.debug_dir, f"rank{rank}") if c.debug_log else None
        return compile_tensor_parallel(module, layout_of(module).group, split_layers(module), inner=c.backend,
                                       debug_dir=debug_dir)  # fmt: skip
    if built.compiled_forward is not None:
        return built.compiled_forward
    if cfg.torch_compile.enabled:
        compiled = torch.compile(module, backend=torch_backend(cfg.torch_compile.backend, module))
        if cfg.zero_optimization.stage == 3:  # stage 3's eager store: its first forward checks released reads
            return EagerWhileChecking(module, compiled, built.runtime.params)
        return compiled
    return module


def compile_module(runtime: EngineRuntime, backend: str, compile_kwargs: dict):
    """What ``Engine.compile()`` makes the engine's forward, with :func:`torch_backend`'s backend: at stages 0-2
    the module compiled in place (``nn.Module.compile(backend=..., **compile_kwargs)``, the module itself
    returned); at stage 3 ``torch.compile(module)`` run through :class:`EagerWhileChecking` over the runtime's
    parameter store."""
    module = runtime.module
    backend = torch_backend(backend, module, compile_kwargs)
    if runtime.stage != 3:
        module.compile(backend=backend, **compile_kwargs)
        return module
    return EagerWhileChecking(module, torch.compile(module, backend=backend, **compile_kwargs), runtime.params)


class ReleasedReadChecker(Protocol):
    """What :class:`EagerWhileChecking` reads of stage 3's parameter store (zero_core's ``Stage3``)."""

    @property
    def checks_released_reads(self) -> bool:
        """True while the next forward runs under the store's released-read check (a torch function mode)."""
        ...


class EagerWhileChecking:
    """``torch.compile(module)`` over stage 3's eager hooks: forwards run eagerly while the store checks released
    parameter reads (its first forward, before the first backward records the unit order), compiled after.

    The check is a torch function mode; active while Dynamo traces, it makes Dynamo read tensor attributes wrongly
    (transformers' Llama fails with ``arange() received ... device=torch.Size``, torch 2.13). The store's hooks are
    ``torch.compiler.disable``d, so compiled forwards graph-break at each module that gathers and run its
    collectives eagerly (as DeepSpeed's ZeRO-3 under ``torch.compile``).
    """

    def __init__(self, module: torch.nn.Module, compiled, store: ReleasedReadChecker):
        self.module, self.compiled, self.store = module, compiled, store

    def __call__(self, *args, **kwargs):
        fn = self.module if self.store.checks_released_reads else self.compiled
        return fn(*args, **kwargs)
