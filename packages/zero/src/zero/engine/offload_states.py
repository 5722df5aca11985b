"""``engine.offload_states()`` / ``reload_states()`` (DeepSpeed 0.19.8's, which RLHF frameworks call between rollouts
to free the trainer's memory for generation) over zero_core's stores.

Each state kind (:class:`OffloadStateTypeEnum`, DeepSpeed's names) is a set of storages of the runtime's stores:

* ``lp_params``: the model's parameter storage (stages 0-2: the flat buffers; stage 3: the stored shards);
* ``hp_params``: the fp32 master shards (a master that *is* the parameter buffer, as in fp32 at stage 0, stays with
  ``lp_params``);
* ``lp_grads`` and ``contiguous_grad_buffer``: the gradient buffers and shards (zero keeps one gradient store: the
  first of the two asked for takes it);
* ``optim_states``: the optimizer's per-parameter tensors.

Offloading copies each storage's bytes to a separate host tensor (pinned when ``pin_memory`` and CUDA is there;
never on CPU-only torch) and resizes the storage to 0 bytes, which frees it while every view (parameters, bucket
views, optimizer state entries) keeps its identity; reloading resizes it back and copies the bytes in, so training
continues bit for bit. On a CPU-only machine "to the cpu" is exactly this move into host copies.
"""

from __future__ import annotations

import enum
from collections.abc import Container, Iterable
from typing import Protocol

import torch

from zero.config import NotSupportedError


class OffloadDeviceEnum(str, enum.Enum):
    """Where ``offload_states`` moves states (DeepSpeed's ``deepspeed.runtime.zero.offload_config`` enum)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """The state kinds ``offload_states(include=...)`` names (DeepSpeed's enum of the same path)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class _Resident(Protocol):
    def resident(self) -> list[torch.Tensor]: ...


class OffloadableRuntime(Protocol):
    """What the offload reads of zero_core's ``ZeroRuntime``: its stores' resident tensors and the optimizer."""

    params: _Resident
    master: _Resident
    reducer: _Resident
    optimizer: torch.optim.Optimizer | None


def _storages(tensors: Iterable[torch.Tensor | None]) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)]


def _kinds(runtime: OffloadableRuntime) -> dict[OffloadStateTypeEnum, list[torch.UntypedStorage]]:
    """Each kind's storages, in claim order: an aliased storage belongs to the first kind listing it."""
    state = runtime.optimizer.state if runtime.optimizer is not None else {}
    optim = [v for per_param in state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    grads = _storages(runtime.reducer.resident())
    return {
        OffloadStateTypeEnum.lp_params: _storages(runtime.params.resident()),
        OffloadStateTypeEnum.lp_grads: grads,
        OffloadStateTypeEnum.contiguous_grad_buffer: grads,
        OffloadStateTypeEnum.hp_params: _storages(runtime.master.resident()),
        OffloadStateTypeEnum.optim_states: _storages(optim),
    }


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class StateOffload:
    """The host copies of the states offloaded now; one per engine (see the module docstring).

    Args:
        runtime: zero_core's ``ZeroRuntime`` (None: the engine's runtime keeps no such stores, e.g. the 1-bit
            optimizers'; then ``offload`` raises NotSupportedError).
    """

    def __init__(self, runtime: OffloadableRuntime | None):
        self.runtime = runtime
        self.offloaded: dict[OffloadStateTypeEnum, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}

    @classmethod
    def of(cls, runtime) -> StateOffload:
        """The offload for an engine's runtime: zero_core's ``ZeroRuntime``, else one that refuses."""
        from zero_core import ZeroRuntime

        return cls(runtime if isinstance(runtime, ZeroRuntime) else None)

    def offload(self, include: Iterable | None, device, pin_memory: bool, non_blocking: bool) -> None:
        """Move the ``include``d kinds (None: all) not offloaded yet to host copies and free their storages."""
        if self.runtime is None:
            raise NotSupportedError(
                "offload_states: this engine's runtime (the 1-bit optimizers') keeps its states outside "
                "zero_core's stores; train with a plain optimizer to use it"
            )
        pin = bool(pin_memory) and torch.cuda.is_available()  # pin_memory() needs CUDA: never on CPU-only torch
        claimed: set[int] = {s.data_ptr() for kept in self.offloaded.values() for s, _ in kept}
        include = list(OffloadStateTypeEnum) if include is None else list(include)
        if OffloadStateTypeEnum.contiguous_grad_buffer in include:  # one gradient store: lp_grads takes it
            include.append(OffloadStateTypeEnum.lp_grads)
        for kind, storages in _kinds(self.runtime).items():
            wanted = kind not in self.offloaded and kind in include
            moved = []
            for storage in storages:
                key = storage.data_ptr()
                if key in claimed or storage.nbytes() == 0:
                    continue
                claimed.add(key)
                if not wanted:
                    continue
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
                host.copy_(_bytes_view(storage), non_blocking=non_blocking and pin)
                moved.append((storage, host))
            if wanted:
                if moved and moved[0][0].device.type != "cpu" and non_blocking:
                    torch.cuda.synchronize()  # the copies must land before the storages are freed
                for storage, _ in moved:
                    storage.resize_(0)
                self.offloaded[kind] = moved

    def reload(self, non_blocking: bool) -> None:
        """Give every offloaded storage its bytes back (same size, same device) and drop the host copies."""
        for moved in self.offloaded.values():
            for storage, host in moved:
                storage.resize_(host.numel())
                _bytes_view(storage).copy_(host, non_blocking=non_blocking)
        self.offloaded.clear()


class OffloadStatesMixin:
    """``offload_states`` / ``reload_states`` on the Engine; expects ``_state_offload`` (a :class:`StateOffload`),
    ``optimizer`` and the config getters."""

    def offload_states(self, include: Container | None = None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:  # fmt: skip
        """Free the named states' memory until :meth:`reload_states`, as DeepSpeed's ``engine.offload_states``.

        Args:
            include: :class:`OffloadStateTypeEnum` members (or their strings); None: every kind. With optimizer
                offload (``offload_optimizer``) ``hp_params`` and ``optim_states`` are left out (and ``lp_grads`` at
                stage 3), as DeepSpeed leaves them: they live on the host already.
            device: ``OffloadDeviceEnum.cpu`` (or "cpu"); ``none`` warns and does nothing.
            pin_memory: pin the host copies (only where CUDA is available).
            non_blocking: copy asynchronously (waited for before the storages are freed).

        Do not run forward/backward/step before ``reload_states()``.

        Raises:
            ValueError: ``device`` nvme (DeepSpeed's).
            AssertionError: parameters offloaded by ``offload_param``, or an engine without an optimizer
                (DeepSpeed's).
        """
        import warnings

        device = OffloadDeviceEnum(getattr(device, "value", device))
        offload_param = self.config.zero_optimization.offload_param
        if offload_param is not None and offload_param.device != "none":
            raise AssertionError("Moving states across devices is not supported for offloaded parameters.")
        if self.optimizer is None:
            raise AssertionError("Moving states across devices is not supported without an optimizer.")
        if device == OffloadDeviceEnum.none:
            warnings.warn("No device specified for offloading states.", stacklevel=2)
            return
        if device == OffloadDeviceEnum.nvme:
            raise ValueError("NVMe offload is not supported for offloading states.")
        kinds = list(OffloadStateTypeEnum) if include is None else [OffloadStateTypeEnum(k) for k in include]
        if self.zero_use_cpu_optimizer():
            skip = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
            if self.zero_optimization_partition_weights():
                skip.add(OffloadStateTypeEnum.lp_grads)
            kinds = [k for k in kinds if k not in skip]
        self._state_offload.offload(kinds, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back every state :meth:`offload_states` moved (DeepSpeed's ``engine.reload_states``).

        Raises:
            AssertionError: an engine without an optimizer (DeepSpeed's).
        """
        if self.optimizer is None:
            raise AssertionError("Moving states across devices is not supported without an optimizer.")
        self._state_offload.reload(non_blocking)
