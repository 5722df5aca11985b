"""1-bit LAMB (Li et al. 2021, arXiv 2104.06069, Algorithm 1) with DeepSpeed's ``OnebitLamb`` parameters."""

from __future__ import annotations

import torch

from zero.optim.closure import loss_of
from zero.optim.onebit.base import CompressedOptimizer


class OneBitLamb(CompressedOptimizer):
    """LAMB for ``freeze_step`` steps, then 1-bit compressed momentum with frozen variance and an adaptive factor.

    Warm-up (gradients all-reduced in full precision): per tensor ``m``, ``v`` as Adam; ``u = m / (sqrt(v) + eps)
    + wd p``; ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 when a norm is 0); ``p -= lr c u``; the frozen
    coefficient ``c_f`` is an EMA (``coeff_beta``) of the ``c`` that are not 1. The last warm-up step copies ``v`` to
    a fresh variance ``v'``. Compression stage: every tensor's momentum ``m = b1 m + (1 - b1) g_local`` is scaled by
    ``scaling_coeff`` (set once: the mean of all tensors' ``||m|| / sqrt(n)`` over this tensor's), all momenta go
    through one 1-bit compressed all-reduce as one flat vector, are unscaled; the gradient is reconstructed as
    ``(m - b1 m_prev) / (1 - b1)`` to update ``v'``; ``factor = max((sqrt(v) + eps) / (sqrt(v') + eps))``, blended
    toward 1 by ``||m / denom|| / ||u||`` when weight decay is on, clamped to ``[factor_min, factor_max]`` and to
    ``1 +- factor_threshold`` times the previous factor; ``p -= lr c_f factor u``. No bias correction, as
    DeepSpeed's (``bias_correction`` accepted and ignored); the first ``step()`` updates the parameters.
    """

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1):  # fmt: skip
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                        weight_decay=weight_decay, bias_correction=bias_correction, max_coeff=max_coeff,
                        min_coeff=min_coeff)  # fmt: skip
        super().__init__(params, defaults)
        if freeze_step < 0 or not 0 <= min_coeff <= max_coeff or not 0 < factor_min <= factor_max:
            raise ValueError("OneBitLamb: need freeze_step >= 0, 0 <= min_coeff <= max_coeff, "
                             f"0 < factor_min <= factor_max; got {freeze_step}, {min_coeff}, {max_coeff}, "
                             f"{factor_min}, {factor_max}")  # fmt: skip
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.flat_errors: dict = {}  # error buffers of the one fused compressed all-reduce

    @property
    def reduce_gradients(self) -> bool:
        """Full-precision gradient all-reduce during the ``freeze_step`` warm-up steps only."""
        return self.steps < self.freeze_step

    def _live(self):
        return [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every tensor with a ``.grad``; collective after warm-up (every rank must call it)."""
        loss = loss_of(closure)
        if self.reduce_gradients:
            self._warmup_step()
        else:
            self._compressed_step()
        self.steps += 1
        return loss

    def _warmup_step(self) -> None:
        last = self.steps + 1 == self.freeze_step
        for group, p in self._live():
            b1, b2 = group["betas"]
            st = self.state[p]
            m, v = self._state(p, st)
            st.setdefault("lamb_coeff_freeze", 0.0)
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            if last:
                st["exp_avg_sq_fresh"] = v.clone()
            u = m / self._denom(v, group)
            if group["weight_decay"]:
                u.add_(p, alpha=group["weight_decay"])
            w_norm, u_norm = float(p.norm()), float(u.norm())
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                st["lamb_coeff_freeze"] = self.coeff_beta * st["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
            p.add_(u, alpha=-group["lr"] * coeff)

    def _compressed_step(self) -> None:
        live = self._live()
        states = [self.state[p] for _, p in live]
        for (_, p), st in zip(live, states):
            self._state(p, st)
            st.setdefault("lamb_coeff_freeze", 0.0)
            st.setdefault("exp_avg_sq_fresh", st["exp_avg_sq"].clone())  # freeze_step 0: no warm-up copy
            st.setdefault("last_factor", 1.0)
        if "scaling_coeff" not in states[0]:
            scales = [float(st["exp_avg"].norm()) / st["exp_avg"].numel() ** 0.5 for st in states]
            united = sum(scales) / len(scales)
            for st, s in zip(states, scales):
                st["scaling_coeff"] = united / s if s > 0 else 1.0
        previous = [st["exp_avg"].clone() for st in states]
        for (group, p), st in zip(live, states):
            b1 = group["betas"][0]
            st["exp_avg"].mul_(b1).add_(p.grad, alpha=1 - b1).mul_(st["scaling_coeff"])
        flat = torch.cat([st["exp_avg"].reshape(-1) for st in states])
        flat = self._all_reduce_1bit(flat, self.flat_errors)
        for st, part in zip(states, flat.split([st["exp_avg"].numel() for st in states])):
            st["exp_avg"].copy_(part.view_as(st["exp_avg"])).div_(st["scaling_coeff"])
        for (group, p), st, m_prev in zip(live, states, previous):
            b1, b2 = group["betas"]
            m, v, fresh = st["exp_avg"], st["exp_avg_sq"], st["exp_avg_sq_fresh"]
            g = (m - b1 * m_prev) / (1 - b1)
            fresh.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = self._denom(v, group)
            prelim = m / denom
            u = prelim + group["weight_decay"] * p if group["weight_decay"] else prelim
            factor = float((denom / self._denom(fresh, group)).max())
            if group["weight_decay"]:
                ratio = min(1.0, float(prelim.norm() / u.norm()))
                factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last = st["last_factor"]
            factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
            st["last_factor"] = factor
            p.add_(u, alpha=-group["lr"] * st["lamb_coeff_freeze"] * factor)
