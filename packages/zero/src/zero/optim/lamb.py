"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", arXiv 1904.00962, Algorithm 2), with
DeepSpeed's ``FusedLamb`` arguments, defaults and numerics (its CUDA kernel, ``csrc/lamb``):

per parameter tensor, with ``t`` the step and ``g`` the gradient,
``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``; ``u = m / (sqrt(v) + eps) + weight_decay * p``
(``eps_inside_sqrt``: ``m / sqrt(v + eps)``); trust ratio ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)``, or
1 when either norm is 0; ``p -= step_size * c * u`` with ``step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)`` (``lr``
without ``bias_correction``).

torch has no LAMB; this is ours. The trust ratio needs the norms of each *parameter*, while ZeRO hands the
optimizer one flat shard per param group holding pieces of many parameters. :meth:`Lamb.bind_segments` tells it
where each parameter's piece lies in a flat tensor and which process group holds the other pieces; per-parameter
squared norms are then summed over the pieces and all-reduced once per step (one all-reduce of 2 x parameters
fp64 values), so every stage computes what a single process computes. Unbound tensors are one parameter each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_comm import all_reduce


@dataclass(frozen=True)
class Segments:
    """Where parameters lie in one flat tensor: ``runs`` of ``(start, end, param_id)`` covering it in order
    (``param_id`` -1 for padding), ``num_params`` ids in all, ``group`` the process group holding the other
    pieces (None: this tensor holds whole parameters)."""

    runs: tuple[tuple[int, int, int], ...]
    num_params: int
    group: object = None


class Lamb(torch.optim.Optimizer):
    """Layer-wise adaptive moments (see the module docstring for the update).

    Args:
        params: tensors or param-group dicts.
        lr: > 0. bias_correction: scale the step by ``sqrt(1 - b2^t) / (1 - b1^t)``. betas: in [0, 1).
        eps: > 0. eps_inside_sqrt: ``sqrt(v + eps)`` instead of ``sqrt(v) + eps``. weight_decay: >= 0, added to
        the update before the trust ratio (L2 inside LAMB, as DeepSpeed). max_coeff, min_coeff: trust ratio bounds.

    State per tensor: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (the tensor's shape, dtype).

    Raises:
        ValueError: an argument out of range, naming it.
    """

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01):  # fmt: skip
        checks = {"lr": lr > 0, "eps": eps > 0, "weight_decay": weight_decay >= 0,
                  "betas": all(0.0 <= b < 1.0 for b in betas), "min_coeff": 0 <= min_coeff <= max_coeff}  # fmt: skip
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"Lamb: {name} out of range: lr > 0, eps > 0, weight_decay >= 0, betas in [0, 1), "
                                 f"0 <= min_coeff <= max_coeff; got {locals()[name]!r}")  # fmt: skip
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff)  # fmt: skip
        super().__init__(params, defaults)
        self._segments: dict[int, Segments] = {}

    def bind_segments(self, tensor: torch.Tensor, segments: Segments) -> None:
        """Declare that flat ``tensor`` (one of this optimizer's parameters) holds the pieces ``segments`` names.

        Raises ValueError when the runs do not cover ``tensor`` exactly."""
        covered = sum(e - s for s, e, _ in segments.runs)
        if covered != tensor.numel():
            raise ValueError(f"Lamb.bind_segments: runs cover {covered} elements, the tensor has {tensor.numel()}")
        self._segments[id(tensor)] = segments

    def _trust(self, p: torch.Tensor, u: torch.Tensor, group: dict) -> torch.Tensor | float:
        """Per-element (bound tensors) or scalar trust ratio of ``u`` for ``p``."""
        seg = self._segments.get(id(p))
        if seg is None:
            sums = torch.stack([p.double().pow(2).sum(), u.double().pow(2).sum()]).reshape(1, 2)
            runs, n = ((0, p.numel(), 0),), 1
        else:
            runs, n = seg.runs, seg.num_params
            sums = torch.zeros(n, 2, dtype=torch.float64, device=p.device)
            pf, uf = p.reshape(-1), u.reshape(-1)
            for s, e, pid in runs:
                if pid >= 0:
                    sums[pid, 0] += pf[s:e].double().pow(2).sum()
                    sums[pid, 1] += uf[s:e].double().pow(2).sum()
            if seg.group is not None:
                all_reduce(sums, seg.group, op="sum")
        w, un = sums[:, 0].sqrt(), sums[:, 1].sqrt()
        ratio = (w / un).clamp(group["min_coeff"], group["max_coeff"])
        coef = torch.where((w != 0) & (un != 0), ratio, torch.ones_like(ratio)).to(p.dtype)
        if seg is None:
            return float(coef[0])
        per_run = torch.stack([coef[pid] if pid >= 0 else coef.new_zeros(()) for _, _, pid in runs])
        lengths = torch.tensor([e - s for s, e, _ in runs], device=p.device)
        return torch.repeat_interleave(per_run, lengths).view(p.shape)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a ``.grad`` (collective for tensors bound with a group)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (v + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
                u = m / denom
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                step_size = group["lr"]
                if group["bias_correction"]:
                    step_size *= (1 - b2**t) ** 0.5 / (1 - b1**t)
                p.sub_(u.mul_(self._trust(p, u, group)), alpha=step_size)
        return loss
