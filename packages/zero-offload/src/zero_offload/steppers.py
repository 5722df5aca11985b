"""Who steps one sub-group: zero_kernels' CPU Adam (Adam/AdamW) or the user's ``torch.optim`` class.

A stepper owns the optimizer state of one sub-group and updates its fp32 master range in place from its gradient
range times a coefficient (1/loss_scale x clip coefficient), never modifying the gradient. ``snapshot`` and
``restore`` copy the exact bits of everything a step changes, so SuperOffload's speculative step can be undone
bitwise (DeepSpeed undoes Adam algebraically, which is not exact in floating point).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from zero_kernels import CPUAdam, adam_step

# Optimizer classes whose update is exactly zero_kernels' Adam/AdamW (torch's formula and state layout).
ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW, CPUAdam)


def adam_hyper(optimizer: torch.optim.Optimizer, group: dict) -> dict[str, Any] | None:
    """The CPU Adam arguments of ``group`` (an entry of ``optimizer.param_groups``), or None when that optimizer is
    not plain Adam/AdamW (amsgrad, maximize, another class): then torch steps it instead."""
    if not isinstance(optimizer, ADAM_CLASSES):
        return None
    if group.get("amsgrad") or group.get("maximize"):
        return None
    if isinstance(optimizer, CPUAdam):
        adamw = group["adamw_mode"]
    else:
        adamw = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
    beta1, beta2 = group["betas"]
    return dict(lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw_mode=bool(adamw),
                bias_correction=bool(group.get("bias_correction", True)))  # fmt: skip


class Stepper(Protocol):
    """What the host optimizer and SuperOffload's speculative step use of whoever steps one sub-group."""

    def step(self, master: torch.Tensor, grad: torch.Tensor, coef: float, hyper: dict, out=None) -> None:
        """Update ``master`` (fp32, in place) from ``grad * coef``; ``out``: optional bf16 copy of the result."""

    def snapshot(self) -> None:
        """Copy aside the exact bits of the state a step changes."""

    def restore(self) -> None:
        """Put back the bits of the last ``snapshot``."""

    def state(self) -> dict[str, Any]:
        """torch's optimizer-state layout for this range."""

    def clear(self) -> None:
        """Forget the state (as a freshly built optimizer)."""

    def load_state(self, state: dict[str, Any]) -> None:
        """Take ``state`` (the layout ``state`` returns)."""

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor this stepper owns (state and its backup), for host-memory accounting."""

    def threads(self, n: int) -> Iterator[None]:
        """Context manager: step with ``n`` OpenMP threads inside it (a worker thread's share of the cores)."""


class AdamStepper:
    """Adam/AdamW state of one sub-group (``exp_avg``, ``exp_avg_sq``: fp32 views of host buffers; ``step``: int),
    stepped by ``zero_kernels.adam_step`` in one pass (unscale x clip, update, optional bf16 copy-out).

    Args:
        exp_avg, exp_avg_sq: zeroed fp32 tensors of the sub-group's numel (views into the offload's flat state).
        num_threads: OpenMP threads for the step (None: torch's setting).
    """

    def __init__(self, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, num_threads: int | None = None):
        self.exp_avg, self.exp_avg_sq, self.step_count = exp_avg, exp_avg_sq, 0
        self.num_threads = num_threads
        self._backup: tuple[torch.Tensor, torch.Tensor] | None = None
        self._backup_step = 0

    def step(self, master: torch.Tensor, grad: torch.Tensor, coef: float, hyper: dict, out=None) -> None:
        """Update ``master`` (fp32) from ``grad * coef``; ``out``: optional bf16 tensor receiving the new values."""
        self.step_count += 1
        adam_step(master, grad, self.exp_avg, self.exp_avg_sq, step=self.step_count, grad_scale=coef,
                  bf16_out=out, num_threads=self.num_threads, **hyper)  # fmt: skip

    def snapshot(self) -> None:
        """Copy the state bits aside (buffers allocated once, reused every step)."""
        if self._backup is None:
            self._backup = (torch.empty_like(self.exp_avg), torch.empty_like(self.exp_avg_sq))
        self._backup[0].copy_(self.exp_avg)
        self._backup[1].copy_(self.exp_avg_sq)
        self._backup_step = self.step_count

    def restore(self) -> None:
        """Put back the bits of the last ``snapshot``."""
        self.exp_avg.copy_(self._backup[0])
        self.exp_avg_sq.copy_(self._backup[1])
        self.step_count = self._backup_step

    def state(self) -> dict[str, Any]:
        """torch's Adam state layout for this range: ``step`` (0-dim fp32), ``exp_avg``, ``exp_avg_sq``."""
        return {"step": torch.tensor(float(self.step_count)), "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def clear(self) -> None:
        self.step_count = 0
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()

    def load_state(self, state: dict[str, Any]) -> None:
        self.step_count = int(float(state["step"]))
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])

    def held_tensors(self) -> list[torch.Tensor]:
        return [self.exp_avg, self.exp_avg_sq, *(self._backup or ())]

    @contextmanager
    def threads(self, n: int) -> Iterator[None]:
        saved, self.num_threads = self.num_threads, n
        try:
            yield
        finally:
            self.num_threads = saved


class TorchStepper:
    """Any ``torch.optim.Optimizer`` class over one sub-group: a new instance of the user's class holding one
    parameter (a view of the master range), with the user's hyper-parameters copied in before every step (so LR
    schedulers acting on the user's optimizer are followed).

    Args:
        master: the fp32 master range (a view; updated in place).
        optimizer: the user's optimizer (its class is instantiated; its param group supplies hyper-parameters).
        group: the user's param group this range belongs to.
    """

    def __init__(self, master: torch.Tensor, optimizer: torch.optim.Optimizer, group: dict):
        self.param = torch.nn.Parameter(master, requires_grad=True)  # shares master's storage
        hyper = {k: v for k, v in group.items() if k != "params"}
        self.optimizer = type(optimizer)([{"params": [self.param], **hyper}], **_defaults(optimizer))
        self._backup: dict | None = None

    def step(self, master: torch.Tensor, grad: torch.Tensor, coef: float, hyper: dict, out=None) -> None:
        pg = self.optimizer.param_groups[0]
        for k, v in hyper.items():
            pg[k] = v
        self.param.grad = grad * coef if coef != 1.0 else grad
        self.optimizer.step()
        self.param.grad = None
        if out is not None:
            out.copy_(master)

    def snapshot(self) -> None:
        """Copy the optimizer state aside (the master range itself is kept by the caller)."""
        st = self.optimizer.state.get(self.param, {})
        self._backup = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}

    def restore(self) -> None:
        st = self._backup
        if st:
            self.optimizer.state[self.param] = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        else:
            self.optimizer.state.pop(self.param, None)

    def state(self) -> dict[str, Any]:
        return dict(self.optimizer.state.get(self.param, {}))

    def clear(self) -> None:
        self.optimizer.state.pop(self.param, None)

    def load_state(self, state: dict[str, Any]) -> None:
        self.optimizer.state[self.param] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}

    def held_tensors(self) -> list[torch.Tensor]:
        held = list(self.optimizer.state.get(self.param, {}).values()) + list((self._backup or {}).values())
        return [t for t in held if torch.is_tensor(t)]

    @contextmanager
    def threads(self, n: int) -> Iterator[None]:
        # torch's optimizers run on torch's intra-op pool, shared by the process: nothing per stepper to set.
        yield


def _defaults(optimizer: torch.optim.Optimizer) -> dict:
    # Constructor keywords the class accepts, taken from the user's instance (e.g. SGD needs lr in some versions).
    import inspect

    names = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in names}
