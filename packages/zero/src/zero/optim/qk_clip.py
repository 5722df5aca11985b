"""MuonClip's QK-clip (Kimi K2 report, arXiv 2507.20534, section 2.1), the option ``qk_clip_threshold`` of Muon.

After each optimizer step, an attention head ``h`` whose largest pre-softmax logit of the step,
``S_max^h = max_{i,j} q_i^h . k_j^h`` (scaled as the attention scales it, over every micro-batch of the step and
every data-parallel rank), is above the threshold ``tau`` gets ``gamma_h = tau / S_max^h`` and its projections are
scaled in place, so its next logits shrink by ``gamma_h``:

* a head with its own key head (multi-head attention): the query rows of ``h`` and its key rows by
  ``sqrt(gamma_h)`` each, as K2 does for its per-head components;
* a key head shared by several query heads (grouped-query attention): the query rows of ``h`` by ``gamma_h`` and the
  shared key untouched, as K2 leaves its shared rotary key untouched (scaling a shared key would clip heads that did
  not exceed ``tau``).

Heads at or under ``tau`` are untouched. The projections are ``nn.Linear`` weights ``(heads * head_dim, in)``, rows
grouped by head (the usual layout); a projection bias is not scaled, so clip exactly only bias-free projections.
The model reports ``S_max`` per head with :meth:`QKClip.observe` each micro-batch (it keeps the running maximum) and
the observations are consumed by the step's clip; a pair with no observation in a step is not clipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zero_core.partitioned_param import ZeroParameter


def full_shape(p: torch.Tensor) -> torch.Size:
    """``p``'s full shape, also while a stage-3 runtime or ``zero.Init`` holds only its shard."""
    return p.ds_shape if isinstance(p, ZeroParameter) else p.shape


@dataclass(frozen=True, eq=False)
class QKPair:
    """One attention layer's query and key projection weights (``(num_heads * head_dim, in)`` and
    ``(num_kv_heads * head_dim, in)``)."""

    q: torch.nn.Parameter
    k: torch.nn.Parameter
    num_heads: int
    num_kv_heads: int


def clip_factors(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """``gamma_h = min(1, tau / S_max^h)`` per head (fp32; 1 where ``S_max^h <= tau``)."""
    s = max_logits.to(torch.float32)
    return torch.where(s > threshold, threshold / s.clamp_min(threshold), torch.ones_like(s))


def row_scales(pair: QKPair, gamma: torch.Tensor, q_rows: int, k_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row multipliers of the query (``q_rows``) and key (``k_rows``) weights for factors ``gamma``
    (``num_heads``): see the module docstring."""
    head_dim = q_rows // pair.num_heads
    if pair.num_kv_heads == pair.num_heads:
        root = gamma.sqrt()
        return root.repeat_interleave(head_dim), root.repeat_interleave(head_dim)
    return gamma.repeat_interleave(head_dim), torch.ones(k_rows)


# scale_rows(param, per_row): multiply each row of ``param``'s weights (its fp32 master where there is one) by
# ``per_row`` (``param``'s first dimension); agree(t): ``t`` maximised over the data-parallel ranks, in place
ScaleRows = Callable[[torch.nn.Parameter, torch.Tensor], None]


class QKClip:
    """The QK-clip state of one Muon optimizer: registered pairs, this step's observed maxima.

    Args:
        threshold: ``tau`` (> 0), in the attention's logit units.

    Raises:
        ValueError: a threshold not > 0.
    """

    def __init__(self, threshold: float):
        if not threshold > 0:
            raise ValueError(f"Muon: qk_clip_threshold must be > 0, got {threshold!r}")
        self.threshold = float(threshold)
        self.pairs: list[QKPair] = []
        self.observed: dict[int, torch.Tensor] = {}  # id(pair.q) -> running max of S_max per head this step

    def register(self, q: torch.nn.Parameter, k: torch.nn.Parameter, num_heads: int, num_kv_heads: int | None = None):
        """Clip attention layer ``(q, k)`` (its ``num_heads`` query heads share ``num_kv_heads`` key heads,
        default ``num_heads``). Shapes are the logical ones (under ``zero.Init`` too).

        Raises:
            ValueError: head counts that do not divide the rows, or ``num_heads`` not a multiple of
                ``num_kv_heads``.
        """
        kv = num_heads if num_kv_heads is None else num_kv_heads
        qs, ks = full_shape(q), full_shape(k)
        if len(qs) != 2 or len(ks) != 2 or qs[0] % num_heads or ks[0] % kv or num_heads % kv:
            raise ValueError(f"Muon qk_clip: q {tuple(qs)} / k {tuple(ks)} do not split into {num_heads} query "
                             f"and {kv} key heads of one head_dim")  # fmt: skip
        if qs[0] // num_heads != ks[0] // kv:
            raise ValueError(f"Muon qk_clip: q and k head_dim differ ({qs[0] // num_heads} vs {ks[0] // kv})")
        self.pairs.append(QKPair(q, k, num_heads, kv))

    def observe(self, q: torch.nn.Parameter, max_logits: torch.Tensor) -> None:
        """Record this micro-batch's largest logit per head of the layer whose query weight is ``q``
        (``num_heads`` values); the step uses the maximum over the step's observations.

        Raises:
            ValueError: ``q`` not registered, or the wrong number of values.
        """
        pair = next((p for p in self.pairs if p.q is q), None)
        if pair is None:
            raise ValueError("Muon qk_clip: observe() for a query weight that was not registered (register_qk)")
        s = max_logits.detach().reshape(-1).to(torch.float32, copy=True).cpu()
        if s.numel() != pair.num_heads:
            raise ValueError(f"Muon qk_clip: {pair.num_heads} max logits expected (one per head), got {s.numel()}")
        prev = self.observed.get(id(q))
        self.observed[id(q)] = s if prev is None else torch.maximum(prev, s)

    @torch.no_grad()
    def apply(self, scale_rows: ScaleRows, agree: Callable[[torch.Tensor], None] | None = None) -> int:
        """Clip every registered pair after a step and forget the observations; returns the heads clipped.
        ``agree`` (collective; every rank calls ``apply`` after every step) maximises the observations over the
        data-parallel ranks first, unobserved pairs as ``-inf``."""
        if not self.pairs:
            return 0
        unseen = float("-inf")
        stacked = torch.cat([self.observed.get(id(p.q), torch.full((p.num_heads,), unseen)) for p in self.pairs])
        self.observed.clear()
        if agree is not None:
            agree(stacked)
        clipped, pos = 0, 0
        for p in self.pairs:
            gamma = clip_factors(stacked[pos : pos + p.num_heads], self.threshold)
            pos += p.num_heads
            if bool((gamma < 1).any()):
                q_rows, k_rows = row_scales(p, gamma, full_shape(p.q)[0], full_shape(p.k)[0])
                scale_rows(p.q, q_rows)
                if bool((k_rows != 1).any()):
                    scale_rows(p.k, k_rows)
                clipped += int((gamma < 1).sum())
        return clipped


def scale_dense_rows(param: torch.nn.Parameter, per_row: torch.Tensor) -> None:
    """``ScaleRows`` of a parameter that holds its whole value (outside zero's runtime)."""
    param.mul_(per_row.to(param.device, param.dtype).view(-1, *([1] * (param.dim() - 1))))
