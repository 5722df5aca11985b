"""0/1 Adam (Lu et al. 2022, arXiv 2202.06009, Algorithm 1) with DeepSpeed's ``ZeroOneAdam`` parameters."""

from __future__ import annotations

import torch

from zero.optim.closure import loss_of
from zero.optim.onebit.base import CompressedOptimizer


class ZeroOneAdam(CompressedOptimizer):
    """Adam whose variance is refreshed at exponentially spaced steps and whose communication is 1-bit or skipped.

    Until ``var_freeze_step``: on a variance step (every ``var_interval``-th step; the interval doubles after every
    ``var_update_scaler`` variance updates) the gradients arrive all-reduced in full precision and ``m`` and ``v``
    are updated; on other steps the local gradient is averaged through the 1-bit compressed all-reduce and only
    ``m`` is updated. After ``var_freeze_step`` the variance is frozen and ranks take local steps, accumulating
    ``u += -lr * update``; every ``local_step_interval`` steps (1, doubling every ``local_step_scaler`` steps, at
    most ``local_step_clipper``) the local moves are undone, ``u * (sqrt(v) + eps)`` is 1-bit all-reduced, the
    momentum is set to ``-that / sum(lr)`` and the parameters move by ``that / (sqrt(v) + eps)``.
    The update is ``m / (sqrt(v) + eps) + weight_decay * p`` without bias correction, as DeepSpeed's ZeroOneAdam
    (``bias_correction`` accepted and ignored); its first ``step()`` updates parameters (DeepSpeed's only
    initializes). State per tensor: ``exp_avg``, ``exp_avg_sq``, ``momentum_accumulator``, error buffers.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                        weight_decay=weight_decay, bias_correction=bias_correction)  # fmt: skip
        super().__init__(params, defaults)
        for name, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):  # fmt: skip
            if value < 1:
                raise ValueError(f"ZeroOneAdam: {name} must be >= 1, got {value}")
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler, self.local_step_scaler = var_update_scaler, local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.var_interval, self.var_counter = 1, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.frozen = False

    @property
    def reduce_gradients(self) -> bool:
        """True on variance steps before ``var_freeze_step`` (the next step's number is a multiple of the interval)."""
        return not self.frozen and (self.steps + 1) % self.var_interval == 0

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every tensor with a ``.grad``; collective on 1-bit and synchronisation steps."""
        loss = loss_of(closure)
        self.steps += 1
        var_step = not self.frozen and self.steps % self.var_interval == 0
        sync = self.frozen and self.steps % self.local_step_interval == 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m, v = self._state(p, state)
                g = p.grad
                if var_step:
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                elif not self.frozen:
                    g = self._all_reduce_1bit(g, state)
                m.mul_(b1).add_(g, alpha=1 - b1)
                denom = self._denom(v, group)
                update = m / denom
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                if self.frozen:
                    u = state.setdefault("momentum_accumulator", torch.zeros_like(p))
                    u.add_(update, alpha=-group["lr"])
                    state["lrs"] = state.get("lrs", 0.0) + group["lr"]  # sum of lr since the last synchronisation
                    if sync:
                        p.sub_(u)  # undo this rank's local moves, then apply the averaged ones
                        avg = self._all_reduce_1bit(u * denom, state)
                        m.copy_(avg).div_(-state["lrs"])
                        p.add_(avg / denom)
                        u.zero_()
                        state["lrs"] = 0.0
        self._advance(var_step)
        return loss

    def _advance(self, var_step: bool) -> None:
        """The variance and local-step schedules (DeepSpeed's counters), and the freeze after var_freeze_step."""
        if not self.frozen:
            if var_step:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
            if self.steps > self.var_freeze_step:
                self.frozen = True
                for st in self.state.values():  # the errors now measure accumulated momentum, not gradients
                    for key in ("worker_error", "server_error"):
                        if key in st:
                            st[key].zero_()
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
