"""``CompressedRuntime``: ZeRO stage 0 (plain data parallel) for the 1-bit optimizers.

zero_core's runtime always all-reduces gradients at stage 0; 1-bit Adam and 0/1 Adam need to skip that on the
steps where they communicate themselves (DeepSpeed: the optimizer switches the engine's
``enable_backward_allreduce`` off). This runtime keeps gradients in ``.grad`` and, at ``step()``, all-reduces
(averages) them in full precision only when ``optimizer.reduce_gradients`` says so. fp32 only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from zero_comm import all_reduce, broadcast
from zero_core import PrecisionPolicy, StaticLossScaler, StepResult


class CompressedRuntime:
    """The engine's runtime for a :class:`~zero.optim.onebit.base.CompressedOptimizer` (stage 0, fp32).

    Args:
        module: the model (its parameters and buffers are broadcast from the group's rank 0).
        optimizer: a OneBitAdam / ZeroOneAdam over ``module``'s parameters; attached to ``group``.
        group: the data-parallel process group (None: WORLD).
        gradient_clipping: max gradient norm (0: off), applied to the gradients the optimizer sees: the averaged
            ones on full-precision steps, this rank's own otherwise (DeepSpeed's stage-0 fp32 path clips the
            module's local ``.grad`` the same way).
        loss_scaler: None (fp32: a static scale of 1).

    ``step()`` skips on a non-finite gradient on any rank (one 1-element all-reduce agrees on it when gradients
    are local), so every rank issues the same collectives.
    """

    stage = 0

    def __init__(self, module: torch.nn.Module, optimizer, group=None, gradient_clipping: float = 0.0,
                 loss_scaler=None):  # fmt: skip
        self.module, self.optimizer = module, optimizer
        self.group = group or dist.group.WORLD
        self.world, self.rank = self.group.size(), dist.get_rank(self.group)
        self.precision = PrecisionPolicy()
        self.loss_scaler = loss_scaler or StaticLossScaler()
        self.gradient_clipping = float(gradient_clipping)
        self.model_parallel = None  # the 1-bit optimizers run over plain data parallelism only
        self.skipped_steps, self.overflow = 0, False
        self.flat_groups: list = []
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                broadcast(t.data, src, self.group)
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        optimizer.attach(self.group)

    def backward(self, loss: torch.Tensor, *, is_boundary: bool | None = None, retain_graph: bool = False) -> None:
        """Backward of ``loss`` into ``.grad`` (accumulating over micro-batches); nothing is communicated."""
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)

    def step(self) -> StepResult:
        """All-reduce gradients when the optimizer asks, check they are finite, clip, step; clears gradients."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # an unused parameter still takes part in every collective
        grads = [p.grad for p in self.params]
        reduce = self.optimizer.reduce_gradients and self.world > 1
        if reduce:
            flat = torch.cat([g.reshape(-1) for g in grads])
            all_reduce(flat, self.group, op="avg")
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        sq = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).double() for g in grads]).pow(2).sum()
        finite = torch.isfinite(sq).reshape(1).to(torch.float32)
        if not reduce and self.world > 1:
            all_reduce(finite, self.group, op="min")
        norm = math.sqrt(sq.item()) / self.loss_scaler.scale if finite.item() else float("nan")
        self.overflow = not finite.item()
        if self.overflow:
            self.loss_scaler.update(True)
            self.skipped_steps += 1
            self.zero_grad()
            return StepResult(False, True, norm)
        coef = 1.0 / self.loss_scaler.scale
        if self.gradient_clipping > 0:
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.loss_scaler.update(False)
        self.zero_grad()
        return StepResult(True, False, norm)

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        for p in self.params:
            p.grad = None

    def check_outside_writes(self) -> None:
        """Nothing to check: every rank keeps whole parameters and each step replaces them alike."""

    def close(self) -> None:
        """Nothing to remove: this runtime installs no hooks (``Engine.destroy`` leaves the module as it is)."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Name -> fp32 copy of this rank's parameter (identical on every rank after a synchronised step)."""
        return {n: p.detach().float().clone() for n, p in self.module.named_parameters()}

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of params, grads (live ``.grad``), master weights (none) and optimizer state."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        state = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        grads = [p.grad for p in self.params if p.grad is not None]
        return {"params": size(self.module.parameters()), "grads": size(grads), "master": 0, "optimizer": size(state)}
