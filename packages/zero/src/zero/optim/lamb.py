"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", arXiv 1904.00962, Algorithm 2), with
DeepSpeed's ``FusedLamb`` arguments, defaults and numerics (its CUDA kernel, ``csrc/lamb``):

per parameter tensor, with ``t`` the step and ``g`` the gradient,
``m = b1 m + (1 - b1) g``; ``v = b2 v + (1 - b2) g^2``; ``u = m / (sqrt(v) + eps) + weight_decay * p``
(``eps_inside_sqrt``: ``m / sqrt(v + eps)``); trust ratio ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)``, or
1 when either norm is 0; ``p -= step_size * c * u`` with ``step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)`` (``lr``
without ``bias_correction``).

torch has no LAMB; this is ours. The trust ratio needs the norms of each *parameter*, while ZeRO hands the
optimizer shards holding pieces of parameters (one flat shard per param group, or one view per parameter piece).
:meth:`Lamb.bind_segments` tells it where each parameter's piece lies in a tensor, and :meth:`Lamb.bind_key` which
process group holds the other pieces of a flat group; per-parameter squared norms are summed over the pieces and
all-reduced once per flat group and step (2 x parameters fp64 values), so every stage computes what a single process
computes. Unbound tensors are one parameter each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero.optim.closure import loss_of
from zero_comm import all_reduce


@dataclass(frozen=True)
class Segments:
    """Where parameters lie in one tensor: ``runs`` of ``(start, end, param_id)`` covering it in order
    (``param_id`` -1 for padding); ``key`` names the flat group (see :meth:`Lamb.bind_key`) the ids belong to."""

    runs: tuple[tuple[int, int, int], ...]
    key: object


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
        self._keys: dict[object, tuple[int, object]] = {}  # key -> (parameters in the flat group, process group)

    def bind_key(self, key, num_params: int, group=None) -> None:
        """Declare flat group ``key`` with ``num_params`` parameters whose pieces are spread over ``group`` (None:
        this rank holds them whole). Every rank must declare the same keys in the same order: each step
        all-reduces one ``(num_params, 2)`` fp64 tensor per key with a group."""
        self._keys[key] = (num_params, group)

    def bind_segments(self, tensor: torch.Tensor, segments: Segments) -> None:
        """Declare that flat ``tensor`` (one of this optimizer's parameters) holds the pieces ``segments`` names.

        Raises ValueError when the runs do not cover ``tensor`` exactly."""
        covered = sum(e - s for s, e, _ in segments.runs)
        if covered != tensor.numel():
            raise ValueError(f"Lamb.bind_segments: runs cover {covered} elements, the tensor has {tensor.numel()}")
        self._segments[id(tensor)] = segments

    @staticmethod
    def _coef(w: torch.Tensor, un: torch.Tensor, group: dict) -> torch.Tensor:
        ratio = (w / un).clamp(group["min_coeff"], group["max_coeff"])
        return torch.where((w != 0) & (un != 0), ratio, torch.ones_like(ratio))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a ``.grad`` (collective when keys with a group are bound)."""
        loss = loss_of(closure)
        sums = {k: torch.zeros(n, 2, dtype=torch.float64) for k, (n, _) in self._keys.items()}
        pending = []
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
                seg = self._segments.get(id(p))
                if seg is None:  # a whole parameter
                    w, un = p.double().norm().reshape(1), u.double().norm().reshape(1)
                    p.sub_(u.mul_(float(self._coef(w, un, group)[0])), alpha=step_size)
                    continue
                pf, uf = p.reshape(-1), u.reshape(-1)
                for s, e, pid in seg.runs:
                    if pid >= 0:
                        sums[seg.key][pid, 0] += pf[s:e].double().pow(2).sum().cpu()
                        sums[seg.key][pid, 1] += uf[s:e].double().pow(2).sum().cpu()
                pending.append((p, u, group, seg, step_size))
        for key, (_, comm) in self._keys.items():
            if comm is not None:
                all_reduce(sums[key], comm, op="sum")
        for p, u, group, seg, step_size in pending:
            coef = self._coef(sums[seg.key][:, 0].sqrt(), sums[seg.key][:, 1].sqrt(), group).to(p.dtype)
            per_run = torch.stack([coef[pid] if pid >= 0 else coef.new_zeros(()) for _, _, pid in seg.runs])
            lengths = torch.tensor([e - s for s, e, _ in seg.runs])
            p.sub_(u.mul_(torch.repeat_interleave(per_run, lengths).to(p.device).view(p.shape)), alpha=step_size)
        return loss
