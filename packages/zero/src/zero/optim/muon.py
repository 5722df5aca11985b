"""Muon (Jordan et al. 2024, "Muon: MomentUm Orthogonalized by Newton-Schulz") with an auxiliary AdamW, as
DeepSpeed 0.19.8's ``MuonWithAuxAdam`` behind ``"optimizer": {"type": "Muon"}``.

Param groups carry ``use_muon``. A Muon group's parameter ``W`` (gradient ``G``, momentum ``M``, ``beta`` the
``momentum``) steps as

    M <- beta M + (1 - beta) G;   U <- (1 - beta) G + beta M          (Nesterov blend)
    O <- NS5(U) * sqrt(max(1, rows / cols))                           (5 quintic Newton-Schulz iterations)
    W <- W (1 - lr weight_decay) - lr O

``NS5`` normalises ``U`` by its Frobenius norm (+1e-7), works on the wide orientation (transposed when
rows > cols) and iterates ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and (a, b, c) = (3.4445, -4.7750,
2.0315). ``ns_method`` ``"gram"`` (DeepSpeed's default) runs the same polynomial on the small Gram matrix with a
restart after two iterations (equal in exact arithmetic); ``"standard"`` iterates on ``X``. A 4-D weight (a conv
filter) is viewed as ``(out, -1)``; the scale reads the last two dimensions of the original shape, as DeepSpeed.
Where DeepSpeed runs the iterations in fp16 / bf16 when the accelerator has them, zero runs them in the master's
dtype (fp32): the same iteration, rounded less. A non-finite gradient leaves the momentum unchanged (the loss
scaler skips such a step anyway, as DeepSpeed). The other groups step AdamW (``adam_w_mode`` false: Adam with
L2 decay): ``m, v`` with bias correction, ``W <- W (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)``.

Two choices follow torch's single-process semantics rather than DeepSpeed's ZeRO optimizers: ``gradient_clipping``
scales the gradient before Muon sees it (``clip_grad_norm_`` then ``step()``; DeepSpeed 0.19.8 at ZeRO 1-3 takes
the norm over the orthogonalised update instead), and a parameter without a gradient in a step is skipped (no
momentum decay, no weight decay; DeepSpeed steps it with a zero gradient).

MuonClip (``qk_clip_threshold``, Kimi K2's QK-clip, :mod:`zero.optim.qk_clip`): after each step, the query and key
projections registered with :meth:`Muon.register_qk` are scaled per head where the largest attention logit the model
reported with :meth:`Muon.observe_max_logits` exceeded the threshold. Outside an engine ``step()`` does it; under an
engine the engine does it after its step, on the fp32 master weights, the logits maximised over the ranks.

Under ZeRO the master store hands this optimizer 1-D pieces of the flat shards; it implements
:class:`zero_core.matrix_step.WholeMatrixOptimizer`, so the core assembles each Muon matrix whole before
:meth:`Muon.finish` (see that module). Alone (no runtime) a Muon group's parameters must have their real shapes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zero.optim.closure import loss_of
from zero.optim.qk_clip import QKClip, scale_dense_rows

_A, _B, _C = 3.4445, -4.7750, 2.0315
NS_STEPS = 5
NS_METHODS = ("gram", "standard")


def _normalised_wide(u: torch.Tensor) -> tuple[torch.Tensor, bool]:
    tall = u.size(-2) > u.size(-1)
    x = u.mT if tall else u
    return x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7), tall


def newton_schulz(u: torch.Tensor, steps: int = NS_STEPS, method: str = "gram") -> torch.Tensor:
    """The approximate orthogonalisation of ``u`` (``(..., rows, cols)``, floating; batched over leading dims):
    ``steps`` quintic Newton-Schulz iterations after Frobenius normalisation, in ``u``'s dtype. Raises ValueError
    for an unknown ``method`` (``"gram"`` or ``"standard"``) or fewer than 2 dimensions."""
    if method not in NS_METHODS:
        raise ValueError(f"Muon: ns_method must be one of {NS_METHODS}, got {method!r}")
    if u.dim() < 2:
        raise ValueError(f"Muon: Newton-Schulz needs a matrix, got shape {tuple(u.shape)}")
    x, tall = _normalised_wide(u)
    if method == "standard" or x.size(-2) == x.size(-1):
        for _ in range(steps):
            a = x @ x.mT
            x = _A * x + (_B * a + _C * a @ a) @ x
        return x.mT if tall else x
    r, q = x @ x.mT, None  # Gram form: X_k = Q_k X_0 with R = X X^T (the small side), restarted after 2 steps
    eye = torch.eye(r.size(-1), dtype=r.dtype, device=r.device)
    for i in range(steps):
        if i == 2:
            x = q @ x
            r, q = x @ x.mT, None
        z = _B * r + _C * r @ r
        q = z + _A * eye if q is None else _A * q + z @ q
        if i < steps - 1 and i + 1 != 2:
            rz = _A * r + z @ r
            r = _A * rz + z @ rz
    x = q @ x
    return x.mT if tall else x


def orthogonalised(u: torch.Tensor, method: str = "gram", steps: int = NS_STEPS) -> torch.Tensor:
    """Muon's update of a blended momentum ``u`` (a parameter's shape, >= 2 dims): ``newton_schulz`` (a 4-D
    tensor viewed as ``(shape[0], -1)``) times ``sqrt(max(1, shape[-2] / shape[-1]))``, in ``u``'s shape."""
    m = u.reshape(u.size(0), -1) if u.dim() == 4 else u
    rows, cols = u.size(-2), u.size(-1)
    return (newton_schulz(m, steps, method) * (math.sqrt(rows / cols) if rows > cols else 1.0)).reshape(u.shape)


class Muon(torch.optim.Optimizer):
    """Muon for groups with ``use_muon`` true, AdamW for the others (see the module docstring).

    Args:
        params: param-group dicts, each with ``use_muon`` (bool); a Muon group takes ``lr`` (0.02), ``momentum``
            (0.95), ``weight_decay`` (0), ``ns_method`` ("gram"); an Adam group ``lr`` (3e-4), ``betas``
            ((0.9, 0.95)), ``eps`` (1e-10), ``weight_decay`` (0): DeepSpeed's ``MuonWithAuxAdam`` defaults.
        adam_w_mode: decoupled weight decay in the Adam groups (False: L2 added to the gradient).
        qk_clip_threshold: MuonClip's ``tau`` (> 0; None: off): see :mod:`zero.optim.qk_clip`.

    State: Muon pieces ``momentum_buffer`` (the parameter's shape and dtype); Adam pieces ``step`` (a float
    scalar tensor), ``exp_avg``, ``exp_avg_sq``.

    Raises:
        ValueError: a group without ``use_muon``, a value out of range (naming it), or at ``step()`` a Muon
            parameter with fewer than 2 dimensions outside zero's runtime.
    """

    def __init__(self, params, adam_w_mode: bool = True, qk_clip_threshold: float | None = None):
        groups = list(params)
        for i, pg in enumerate(groups):
            if not isinstance(pg, dict) or "use_muon" not in pg:
                raise ValueError(f"Muon: param group {i} must be a dict with 'use_muon' (True for hidden matrices)")
            if pg["use_muon"]:
                for k, v in (("lr", 0.02), ("momentum", 0.95), ("weight_decay", 0.0), ("ns_method", "gram")):
                    pg.setdefault(k, v)
            else:
                for k, v in (("lr", 3e-4), ("betas", (0.9, 0.95)), ("eps", 1e-10), ("weight_decay", 0.0)):
                    pg.setdefault(k, v)
            self._check(i, pg)
        super().__init__(groups, {"adam_w_mode": adam_w_mode})
        self.qk_clip = QKClip(qk_clip_threshold) if qk_clip_threshold is not None else None
        self.clips_in_step = True  # False once an engine owns the step: it clips after stepping its master weights

    def register_qk(self, q: torch.nn.Parameter, k: torch.nn.Parameter, num_heads: int,
                    num_kv_heads: int | None = None) -> None:  # fmt: skip
        """MuonClip: clip the attention layer with query weight ``q`` and key weight ``k`` (``nn.Linear`` weights,
        rows grouped by head) after each step. Raises ValueError without ``qk_clip_threshold`` or for head counts
        that do not divide the weights (``QKClip.register``)."""
        if self.qk_clip is None:
            raise ValueError("Muon.register_qk: build Muon with qk_clip_threshold (optimizer.params) to use QK-clip")
        self.qk_clip.register(q, k, num_heads, num_kv_heads)

    def observe_max_logits(self, q: torch.nn.Parameter, max_logits: torch.Tensor) -> None:
        """MuonClip: this micro-batch's largest attention logit per head (``num_heads`` values) of the layer whose
        query weight is ``q``; the step clips with the maximum over its micro-batches (and ranks, under an
        engine)."""
        if self.qk_clip is None:
            raise ValueError("Muon.observe_max_logits: build Muon with qk_clip_threshold to use QK-clip")
        self.qk_clip.observe(q, max_logits)

    def hand_clip_to_engine(self) -> None:
        """An engine steps this optimizer's pieces of the master weights: ``step()`` no longer clips; the engine
        calls ``qk_clip.apply`` after its step."""
        self.clips_in_step = False

    @staticmethod
    def _check(i: int, pg: dict) -> None:
        bad = []
        if pg["lr"] < 0 or pg["weight_decay"] < 0:
            bad.append(f"lr {pg['lr']} / weight_decay {pg['weight_decay']} must be >= 0")
        if pg["use_muon"]:
            if not 0.0 <= pg["momentum"] < 1.0:
                bad.append(f"momentum {pg['momentum']} must be in [0, 1)")
            if pg["ns_method"] not in NS_METHODS:
                bad.append(f"ns_method {pg['ns_method']!r} must be one of {NS_METHODS}")
        elif not all(0.0 <= b < 1.0 for b in pg["betas"]) or pg["eps"] < 0:
            bad.append(f"betas {pg['betas']} must be in [0, 1) and eps {pg['eps']} >= 0")
        if bad:
            raise ValueError(f"Muon: param group {i}: " + "; ".join(bad))

    # ------------------------------------------------------------ zero_core.matrix_step.WholeMatrixOptimizer
    def whole_matrix_group(self, group: dict[str, Any]) -> bool:
        """Muon groups need each parameter's whole matrix."""
        return bool(group["use_muon"])

    def blend(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Momentum update and Nesterov blend of ``param``'s ``grad`` (its momentum is kept unchanged when the
        gradient is not finite)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param)
        m, beta = state["momentum_buffer"], group["momentum"]
        g = grad.reshape(m.shape).to(m.dtype)
        m.copy_(torch.where(torch.isfinite(g).all(), m.lerp(g, 1 - beta), m))
        return g.lerp(m, beta)

    def finish(self, matrix: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The orthogonalised, scaled update of one whole blended matrix."""
        return orthogonalised(matrix, group["ns_method"])

    def apply(self, param: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
        """Decoupled weight decay, then ``param -= lr * update``."""
        if group["weight_decay"]:
            param.mul_(1 - group["lr"] * group["weight_decay"])
        param.add_(update.reshape(param.shape).to(param.dtype), alpha=-group["lr"])

    # ------------------------------------------------------------ torch.optim.Optimizer
    def _adam(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        b1, b2 = group["betas"]
        grad = p.grad if self.defaults["adam_w_mode"] else p.grad.add(p, alpha=group["weight_decay"])
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].lerp_(grad, 1 - b1)
        state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
        if self.defaults["adam_w_mode"] and group["weight_decay"]:
            p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a ``.grad`` (a Muon parameter here must have its real shape)."""
        loss = loss_of(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not group["use_muon"]:
                    self._adam(p, group)
                    continue
                if p.dim() < 2:
                    raise ValueError(f"Muon: a Muon parameter of shape {tuple(p.shape)} needs its whole matrix; "
                                     "under ZeRO zero's runtime assembles it (use zero.initialize)")  # fmt: skip
                self.apply(p, self.finish(self.blend(p, p.grad, group), group), group)
        if self.qk_clip is not None and self.clips_in_step:
            self.qk_clip.apply(scale_dense_rows)
        return loss
