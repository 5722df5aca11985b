"""`compile` (DeepCompile, DeepSpeed 0.19.8 ``deepspeed/compile/config.py`` keys and defaults) and `torch_compile`.

``compile.deepcompile: true`` compiles the model with zero_compile's passes: the forward and backward graphs
gather, release and reduce-scatter ZeRO units themselves (``passes``: "z3" at stage 3, "z1" at stages 1/2; None
picks by stage). ``passes: ["autosp"]`` instead inserts Ulysses sequence parallelism in the graph (the all-to-alls
around every ``scaled_dot_product_attention``) over the sequence-parallel group of ``initialize(mpu=...)``, with
the eager ZeRO optimizer at stage 0 or 1, as DeepSpeed's AutoSP. ``passes: ["autotp"]`` keeps AutoTP's eager split
of the weights (``tensor_parallel.autotp_size`` > 1) and puts its collectives in the graph, so the whole forward
compiles in one graph (zero_compile's autotp pass), with the eager ZeRO optimizer at stage 0 or 1. ``torch_compile``
is plain ``torch.compile`` of the module over the eager engine (the paper's baseline). Keys of DeepCompile features
zero does not build yet raise NotSupportedError naming the key; DeepCompile's mutual exclusions raise ConfigError
naming both keys (:func:`check_compile`).
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, NonNegativeInt, PositiveInt

from zero.config.errors import ConfigError, NotSupportedError

_STRICT = pydantic.ConfigDict(extra="forbid")


class CompileSection(pydantic.BaseModel):
    """`compile`: DeepCompile's keys with DeepSpeed's defaults, plus zero's ``backend``, ``warmup_steps``,
    ``memory_budget_bytes`` and ``debug_dir``.

    Built: ``deepcompile``; ``passes`` (["z3"] / ["z1"], matching ``zero_optimization.stage``); ``double_buffer``
    (true: the prefetch pass moves all-gathers ahead, within the budget; false: no prefetch); ``debug_log`` (each
    pass's graph written under ``debug_dir/rank<r>/``); ``keep_int_input_tensors`` / ``keep_all_input_tensors``
    are accepted and have no effect (zero profiles live warm-up steps with their real inputs, so it stores none).
    ``offload_opt_states`` (optimizer state over ``opt_states_budget_bytes`` in host memory between steps).
    ``passes: ["autosp"]`` (alone; stages 0/1; needs ``initialize(mpu=...)``; each rank feeds its sequence shard, as
    with the eager Ulysses adapter, which must not be registered as well; ``backend`` is the inner compiler).
    ``passes: ["autotp"]`` (alone; stages 0/1; needs ``tensor_parallel.autotp_size`` > 1 without
    ``tp_overlap_comm``; AutoTP splits the weights eagerly, the pass inserts the collectives the split layers
    would run in the graph; ``backend`` is the inner compiler).
    Not built yet (true/non-default -> NotSupportedError): ``offload_parameters``,
    ``offload_activation``, ``free_activation``, ``symmetric_memory``, ``autoep_non_moe``, the ``sync_*`` flags.
    """

    model_config = _STRICT
    deepcompile: bool = False
    autoep_non_moe: bool = False
    free_activation: bool = False
    free_activation_threshold: NonNegativeInt = 10 * 1024 * 1024
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None
    backend: Literal["inductor", "aot_eager"] = "inductor"
    """zero: the inner compiler of the passed graphs (tests use "aot_eager": compiles in about a second)."""
    warmup_steps: NonNegativeInt = 2
    """zero: optimizer steps profiled before prefetch and selective unsharding are planned (0: never)."""
    memory_budget_bytes: PositiveInt | None = None
    """zero: bytes of gathered parameters prefetch and selective unsharding may hold (None: no limit)."""
    opt_states_budget_bytes: NonNegativeInt = 0
    """zero: with ``offload_opt_states``, bytes of optimizer state per rank kept on the device (0: all offloaded)."""
    debug_dir: str = "zero_compile_debug"
    """zero: folder for ``debug_log`` graph dumps."""


class TorchCompileSection(pydantic.BaseModel):
    """`torch_compile`: plain ``torch.compile(module, backend=...)`` over the eager engine (its hooks run as they
    do without compilation; Dynamo breaks the graph around their collectives)."""

    model_config = _STRICT
    enabled: bool = False
    backend: str = Field(default="inductor", min_length=1)


_NOT_BUILT = ("offload_parameters", "offload_activation", "free_activation",
              "symmetric_memory", "autoep_non_moe", "sync_before_reduce", "sync_after_reduce",
              "sync_before_allgather", "sync_after_allgather")  # fmt: skip


def check_compile(cfg) -> None:
    """DeepCompile's rules on a validated EngineConfig ``cfg``.

    Raises:
        ConfigError: a mutual exclusion (naming both keys): ``compile.offload_opt_states`` with
            ``zero_optimization.offload_optimizer`` cpu/nvme; ``compile.offload_activation`` with
            ``compile.offload_parameters`` or ``compile.offload_opt_states``; ``compile.offload_parameters`` with
            ``compile.offload_opt_states``; ``compile.deepcompile`` with ``torch_compile.enabled``; with stage 0
            (except for "autosp" and "autotp"); ``compile.passes`` not matching ``zero_optimization.stage``; "autosp" or
            "autotp" with another pass; "autotp" without ``tensor_parallel.autotp_size`` > 1.
        NotSupportedError: a DeepCompile key zero does not build yet, named; ``compile.deepcompile`` at stage 3 with
            ``zero_optimization.zero_quantized_nontrainable_weights``; "autosp" at stage 2 or 3 or with
            ``compile.offload_opt_states``; "autotp" at stage 2 or 3, with ``compile.offload_opt_states`` or with
            ``tensor_parallel.tp_overlap_comm``.
    """
    c = cfg.compile
    off = getattr(cfg.zero_optimization, "offload_optimizer", None)
    if c.offload_opt_states and off is not None and off.device in ("cpu", "nvme"):
        raise ConfigError(f"compile.offload_opt_states and zero_optimization.offload_optimizer (device "
                          f"{off.device!r}) are mutually exclusive; use one")  # fmt: skip
    for a, b in (("offload_activation", "offload_parameters"), ("offload_activation", "offload_opt_states"),
                 ("offload_parameters", "offload_opt_states")):  # fmt: skip
        if getattr(c, a) and getattr(c, b):
            raise ConfigError(f"compile.{a} and compile.{b} are mutually exclusive (as in DeepCompile); use one")
    if not c.deepcompile:
        return
    if cfg.torch_compile.enabled:
        raise ConfigError("compile.deepcompile and torch_compile.enabled are mutually exclusive: DeepCompile "
                          "compiles the model itself; set one")  # fmt: skip
    for key in _NOT_BUILT:
        if getattr(c, key):
            raise NotSupportedError(f"config key 'compile.{key}': true is not supported yet by zero")
    stage = cfg.zero_optimization.stage
    if "autosp" in (c.passes or ()):
        _check_autosp(c, stage)
        return
    if "autotp" in (c.passes or ()):
        _check_autotp(cfg)
        return
    if stage == 0:
        raise ConfigError("compile.deepcompile needs zero_optimization.stage 1, 2 or 3, got 0")
    if stage == 3 and cfg.zero_optimization.zero_quantized_nontrainable_weights:
        raise NotSupportedError("compile.deepcompile with zero_optimization.zero_quantized_nontrainable_weights is "
                                "not supported yet by zero: the compiled stage-3 path stores every shard in the "
                                "parameter dtype; use one or the other")  # fmt: skip
    for name in c.passes or ():
        want = "z3" if stage == 3 else "z1"
        if name != want:
            raise ConfigError(f"compile.passes {c.passes} does not match zero_optimization.stage {stage} "
                              f"(stage {stage} uses {want!r})")  # fmt: skip


def _check_autosp(c: CompileSection, stage: int) -> None:
    """``compile.passes`` with "autosp": alone, at ZeRO stage 0 or 1 (DeepSpeed 0.19.8 runs its AutoSP backend
    instead of the ZeRO passes, and falls back to plain ``torch.compile`` at stages 2 and 3)."""
    if c.passes != ["autosp"]:
        raise ConfigError(f"compile.passes {c.passes}: 'autosp' runs alone (the ZeRO optimizer stays eager under "
                          "it, as DeepSpeed's AutoSP); use [\"autosp\"]")  # fmt: skip
    if stage not in (0, 1):
        raise NotSupportedError(f"config key 'zero_optimization.stage': {stage} with compile.passes ['autosp'] is "
                                "not supported (DeepSpeed's AutoSP composes with ZeRO stages 0 and 1 only); use "
                                "stage 0 or 1")  # fmt: skip
    if c.offload_opt_states:
        raise NotSupportedError("config key 'compile.offload_opt_states': true with compile.passes ['autosp'] is not "
                                "supported (it belongs to the ZeRO passes' compiled path); set it false")  # fmt: skip


def _check_autotp(cfg) -> None:
    """``compile.passes`` with "autotp": alone, at ZeRO stage 0 or 1, over an AutoTP split
    (``tensor_parallel.autotp_size`` > 1) whose backward all-reduce is not overlapped (as DeepSpeed's autotp pass,
    which refuses ``tp_overlap_comm``)."""
    c, stage, tp = cfg.compile, cfg.zero_optimization.stage, cfg.tensor_parallel
    if c.passes != ["autotp"]:
        raise ConfigError(f"compile.passes {c.passes}: 'autotp' runs alone (the ZeRO optimizer stays eager under "
                          "it); use [\"autotp\"]")  # fmt: skip
    if tp.size <= 1:
        raise ConfigError(f"compile.passes ['autotp'] needs config key 'tensor_parallel.autotp_size' > 1 (got "
                          f"{tp.autotp_size}): the pass puts AutoTP's collectives in the graph of a split "
                          "model")  # fmt: skip
    if stage not in (0, 1):
        raise NotSupportedError(f"config key 'zero_optimization.stage': {stage} with compile.passes ['autotp'] is "
                                "not supported yet by zero; use stage 0 or 1")  # fmt: skip
    if c.offload_opt_states:
        raise NotSupportedError("config key 'compile.offload_opt_states': true with compile.passes ['autotp'] is not "
                                "supported (it belongs to the ZeRO passes' compiled path); set it false")  # fmt: skip
    if tp.tp_overlap_comm:
        raise NotSupportedError("config key 'tensor_parallel.tp_overlap_comm': true with compile.passes ['autotp'] "
                                "is not supported (the graph's all-reduce is scheduled by the compiler); set it "
                                "false")  # fmt: skip
