"""What the 1-bit optimizers share: the Adam-style update without bias correction, per-tensor error buffers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import compressed_all_reduce, compressed_numel


class CompressedOptimizer(torch.optim.Optimizer):
    """Base of :class:`OneBitAdam`, :class:`ZeroOneAdam` and :class:`OneBitLamb`.

    Each subclass defines the property ``reduce_gradients``: whether the runtime must all-reduce (average) the
    gradients of the coming step in full precision; otherwise each rank's ``.grad`` stays local and the optimizer
    communicates itself. The process group is set by :meth:`attach` (the runtime calls it; default: WORLD).
    """

    def __init__(self, params, defaults: dict):
        for name in ("lr", "eps"):
            if defaults[name] <= 0:
                raise ValueError(f"{type(self).__name__}: {name} must be > 0, got {defaults[name]}")
        if not all(0.0 <= b < 1.0 for b in defaults["betas"]):
            raise ValueError(f"{type(self).__name__}: betas must be in [0, 1), got {defaults['betas']}")
        super().__init__(params, defaults)
        self.group = None
        self.steps = 0  # optimizer steps taken

    def attach(self, group) -> None:
        """Communicate over ``group`` (the data-parallel process group)."""
        self.group = group

    def _group(self):
        return self.group if self.group is not None else dist.group.WORLD

    def _world(self) -> int:
        return self._group().size() if dist.is_initialized() else 1

    def _errors(self, p: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """This tensor's worker and server error buffers (fp32, created as zeros)."""
        if "worker_error" not in state:
            n = compressed_numel(p.numel(), self._world())
            state["worker_error"] = torch.zeros(n, dtype=torch.float32, device=p.device)
            state["server_error"] = torch.zeros(n // self._world(), dtype=torch.float32, device=p.device)
        return state["worker_error"], state["server_error"]

    def _all_reduce_1bit(self, t: torch.Tensor, state: dict) -> torch.Tensor:
        """Average of ``t`` over the group through the 1-bit compressed all-reduce (``t`` itself on one rank)."""
        if self._world() == 1:
            return t
        we, se = self._errors(t, state)
        return compressed_all_reduce(t, we, se, self._group())

    @staticmethod
    def _denom(v: torch.Tensor, group: dict) -> torch.Tensor:
        return (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])

    @staticmethod
    def _state(p: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        return state["exp_avg"], state["exp_avg_sq"]
