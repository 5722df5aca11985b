"""Adaptive optimizer-state offload (``compile.offload_opt_states``): the part of the optimizer state over a device
budget lives in host memory between steps and comes back just before the step.

The core's :class:`~zero_core.master_device.DeviceMaster` keeps master shards and optimizer state on the
parameters' device. :class:`OffloadedStatesMaster` is that store plus two moves around each optimizer step: after
it, the per-element state tensors (Adam's ``exp_avg``, ``exp_avg_sq``...) are walked in flat-group and parameter
order, the first ones are kept on the device while their bytes fit ``budget_bytes``, and each of the rest is copied
into a host buffer of zero-offload (``zero_offload.host_memory.host_empty``: page-locked where an accelerator
allows it) and the device tensor is dropped; before the next step those are copied back to new device tensors. The
values make the round trip unchanged, so training is bitwise that of the device store. Scalars (``step``) stay.

Mirrors DeepCompile's adaptive offloading of optimizer states (arXiv 2504.09983, section 3.5: only what exceeds the
memory budget is offloaded), done synchronously at the step boundary rather than overlapped with the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from zero_core.master import MasterStoreInputs, StepDecision
from zero_core.master_device import DeviceMaster
from zero_offload.host_memory import host_empty

_KEY = "compile.offload_opt_states"


class OffloadedStatesMaster(DeviceMaster):
    """A :class:`~zero_core.master_device.DeviceMaster` whose optimizer state over ``budget_bytes`` is offloaded
    between steps (see the module docstring).

    Args:
        budget_bytes: bytes of per-element optimizer state per rank kept on the device (0: offload all of it).
        pin_memory: ask for page-locked host buffers (falls back to pageable memory with one warning on CPU).
        the rest: as :class:`~zero_core.master_device.DeviceMaster` (:meth:`builder` gives the runtime a callable
            that passes them).

    Attributes:
        offloaded_bytes: bytes of optimizer state in host memory now.
        kept_bytes: bytes of per-element optimizer state on the device after the last offload.

    Raises:
        ValueError: ``budget_bytes`` < 0.
    """

    def __init__(self, *, budget_bytes: int = 0, pin_memory: bool = True, **device_master):
        _check_budget(budget_bytes)
        self.budget_bytes, self.pin_memory = budget_bytes, pin_memory
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (piece id, state name) -> its host buffer
        self._out: dict[tuple[int, str], torch.device] = {}  # offloaded now -> the device it came from
        self.offloaded_bytes = 0
        self.kept_bytes = 0
        super().__init__(**device_master)

    @classmethod
    def builder(
        cls, budget_bytes: int = 0, pin_memory: bool = True
    ) -> Callable[[MasterStoreInputs], OffloadedStatesMaster]:
        """What ``ZeroRuntime(master_store=...)`` takes (the budget is checked now, before any runtime exists)."""
        _check_budget(budget_bytes)
        return functools.partial(cls.from_inputs, budget_bytes=budget_bytes, pin_memory=pin_memory)

    def _state_tensors(self):
        """(piece, state name, tensor) for every per-element floating state, in flat-group and piece order."""
        state = self.optimizer.state
        for pieces in self.pieces.values():  # flat-group order
            for *_, piece in pieces:
                for k, v in state.get(piece, {}).items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point():
                        yield piece, k, v

    @torch.no_grad()
    def offload(self) -> None:
        """Move the state over the budget to host buffers (the first tensors within the budget stay)."""
        state = self.optimizer.state
        kept = moved = 0
        for piece, k, v in self._state_tensors():
            key, nbytes = (id(piece), k), v.numel() * v.element_size()
            if key in self._out:
                moved += nbytes
                continue
            if kept + nbytes <= self.budget_bytes:
                kept += nbytes
                continue
            host = self._host.get(key)
            if host is None or host.numel() != v.numel() or host.dtype != v.dtype:
                host = self._host[key] = host_empty(v.numel(), v.dtype, pin_memory=self.pin_memory, key=_KEY)
            host = host.view(v.shape)
            host.copy_(v, non_blocking=host.is_pinned())
            self._out[key] = v.device
            state[piece][k] = host
            moved += nbytes
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the device tensors are dropped: their copies must have landed
        self.offloaded_bytes, self.kept_bytes = moved, kept

    @torch.no_grad()
    def reload(self) -> None:
        """Copy every offloaded state back to a new tensor on its device (before the optimizer reads it)."""
        if not self._out:
            return
        state = self.optimizer.state
        for piece, k, v in list(self._state_tensors()):
            device = self._out.pop((id(piece), k), None)
            if device is not None:
                state[piece][k] = v.to(device, copy=True)
        self._out.clear()
        self.offloaded_bytes = 0

    def step(self, decision: StepDecision) -> bool:
        """Bring the offloaded state back, step as the device store, offload what is over the budget."""
        self.reload()
        try:
            return super().step(decision)
        finally:
            self.offload()

    def load_state_shard(self, g, state: dict[str, Any]) -> None:
        """As the device store: the loaded state is on the device until the next step offloads it."""
        for *_, piece in self.pieces.get(g.index, []):
            for key in [key for key in self._out if key[0] == id(piece)]:
                del self._out[key]
        super().load_state_shard(g, state)

    def clear_state(self, g) -> None:
        """Drop ``g``'s optimizer state, offloaded parts included."""
        for *_, piece in self.pieces.get(g.index, []):
            for key in [key for key in self._out if key[0] == id(piece)]:
                del self._out[key]
        super().clear_state(g)

    def close(self) -> None:
        """As the device store; host buffers are freed."""
        self._out.clear()
        self._host.clear()
        super().close()


def _check_budget(budget_bytes: int) -> None:
    if budget_bytes < 0:
        raise ValueError(f"{_KEY}: the optimizer-state budget must be >= 0 bytes, got {budget_bytes}")
