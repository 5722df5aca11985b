"""What the Engine uses of its runtime, declared: :class:`EngineRuntime` (zero_core's ``ZeroRuntime`` and the
1-bit optimizers' ``CompressedRuntime`` provide it), :class:`RuntimeCheckpoints` (how that runtime's checkpoints
are written and read) and :class:`BuiltRuntime`, what the builder hands the Engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class LossScaler(Protocol):
    """zero_core's ``StaticLossScaler`` / ``DynamicLossScaler``: the loss multiplier and its checkpointed state."""

    scale: float

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class EngineRuntime(Protocol):
    """The runtime side of ``zero.engine.Engine``.

    Attributes:
        module: the wrapped model.
        optimizer: the torch optimizer stepping the master shards, or None (forward only).
        group: the process group the runtime shards and reduces over.
        precision: zero_core's ``PrecisionPolicy`` (``param_dtype``, ``compute``).
        loss_scaler: the loss scaler (static 1.0 in fp32).
        flat_groups: zero_core's flat-group layout (empty when the runtime keeps parameters unflattened).
        gradient_clipping: max global gradient norm (0: off).
        params: the parameter store (at stage 3 zero_core's, which gathers and releases units).
        model_parallel: the model-parallel split the gradient norm counts (tensor or expert parallelism), or None.
    """

    stage: int
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    group: Any
    precision: Any
    loss_scaler: LossScaler
    flat_groups: Sequence[Any]
    gradient_clipping: float
    params: Any
    model_parallel: Any

    def backward(self, loss: torch.Tensor, *, is_boundary: bool | None = None, retain_graph: bool = False) -> None:
        """Backward of ``loss`` times the loss scale; gradients reduced as the stage says."""

    def step(self) -> Any:
        """The optimizer step at a gradient accumulation boundary (zero_core's ``StepResult``)."""

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of params, grads, master weights and optimizer state."""

    def check_outside_writes(self) -> None:
        """Collective: an error on every rank when some rank wrote a parameter in place outside a gather that
        would leave the ranks' values apart (stage 3's persistent parameters); nothing where none can be."""

    def close(self) -> None:
        """Remove every hook the runtime installed, leaving plain dense parameters (``Engine.destroy``)."""


class RuntimeCheckpoints(Protocol):
    """How one runtime's checkpoints are written and read (zero_core's sharded format, or the 1-bit
    optimizers' own)."""

    def save(self, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config: dict | None,
             save_latest: bool, exclude_frozen: bool) -> None:  # fmt: skip
        """Collective: write ``save_dir/tag`` (and ``latest`` when ``save_latest``)."""

    def load(self, load_dir: str, tag: str | None, load_optimizer_states: bool,
             load_module_only: bool) -> tuple[str, dict, dict]:  # fmt: skip
        """Collective: ``(path, client_state, engine_state)``."""


@dataclass(frozen=True)
class BuiltRuntime:
    """What ``build_engine_runtime`` gives the Engine: the runtime, its checkpoint format, and the compiled
    forward DeepCompile built (None: the Engine calls the module, or ``torch.compile`` of it)."""

    runtime: EngineRuntime
    checkpoints: RuntimeCheckpoints
    compiled_forward: Callable | None = None
