"""Shared reference models, data and training loops for the parity tests (cases.md conventions).

``reference_run`` trains a plain single-process fp32 copy on the whole global batch (mean loss); ``sharded_run``
runs on a rank (inside ``run_ranks``) through ``zero_core.ZeroRuntime`` with rank r taking slice r of every
micro-batch. Both return per-step losses, grad norms and the final full parameters so tests compare values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SEED = 1234
MICRO_PER_RANK = 3


class TinyNet(nn.Module):
    """Linear(8,13) -> GELU -> Linear(13,7) -> GELU -> Linear(7,4): 247 elements (= 13 x 19), no world size
    divides it. ``extra``: an optional Linear(4,4) head (ZC-10); ``noncontig``: layer-2 weight a transposed view
    (ZC-30)."""

    def __init__(self, extra: bool = False, noncontig: bool = False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 13), nn.Linear(13, 7), nn.Linear(7, 4)
        if noncontig:
            self.l2.weight = nn.Parameter(torch.randn(13, 7).t())
        self.extra = nn.Linear(4, 4) if extra else None
        self.use_extra = extra

    def forward(self, x):
        y = self.l3(F.gelu(self.l2(F.gelu(self.l1(x)))))
        if self.extra is not None and self.use_extra:
            y = self.extra(y)
        return y


def build(model: str = "tiny", **kw) -> nn.Module:
    """The model named ``model`` built from ``SEED`` (identical on every process)."""
    torch.manual_seed(SEED)
    return {"tiny": TinyNet}[model](**kw)


def batch(step: int, world: int, gas: int, features: int = 8, classes: int = 4):
    """The global batch of optimizer step ``step``: (x [N, features] in [-1, 1], y [N] int64), N = 3*world*gas."""
    g = torch.Generator().manual_seed(1000 + step)
    n = MICRO_PER_RANK * world * gas
    return torch.rand(n, features, generator=g) * 2 - 1, torch.randint(0, classes, (n,), generator=g)


def make_optimizer(name: str, groups, **kw) -> torch.optim.Optimizer:
    """``adamw`` (lr 1e-2, wd 0.01), ``adam``, ``sgd`` (lr 0.1), ``sgdm`` (momentum 0.9), ``adagrad``."""
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=kw.get("lr", 1e-2), weight_decay=kw.get("wd", 0.01))
    if name == "adam":
        return torch.optim.Adam(groups, lr=kw.get("lr", 1e-2))
    if name == "sgd":
        return torch.optim.SGD(groups, lr=kw.get("lr", 0.1))
    if name == "sgdm":
        return torch.optim.SGD(groups, lr=kw.get("lr", 0.1), momentum=0.9)
    if name == "adagrad":
        return torch.optim.Adagrad(groups, lr=kw.get("lr", 1e-2))
    raise ValueError(name)


def param_groups(model: nn.Module, split: str = "one"):
    """``one``: a single group; ``two``: split in the middle of the parameter list; ``layers``: one per layer."""
    params = list(model.parameters())
    if split == "one":
        return [{"params": params}]
    if split == "two":
        return [{"params": params[:3]}, {"params": params[3:]}]
    if split == "layers":
        return [{"params": list(m.parameters())} for m in (model.l1, model.l2, model.l3)]
    raise ValueError(split)


def reference_run(spec: dict) -> dict:
    """Single-process fp32 training on the global batch; same keys as ``sharded_run``'s result."""
    model = build(spec.get("model", "tiny"), **spec.get("model_kw", {}))
    opt = make_optimizer(spec.get("optimizer", "adamw"), param_groups(model, spec.get("groups", "one")))
    losses, norms = [], []
    world, gas = spec["world"], spec.get("gas", 1)
    for step in range(spec.get("steps", 3)):
        x, y = batch(step, world, gas)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.get("clip") or float("inf"))))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def precision_of(name: str):
    """``fp32`` or ``bf16`` (bf16 storage and communication, fp32 compute, master and accumulation)."""
    from zero_core import PrecisionPolicy

    return PrecisionPolicy() if name == "fp32" else PrecisionPolicy.bf16()


def sharded_run(spec: dict) -> dict:
    """On one rank: build, wrap in ZeroRuntime per ``spec`` and train; returns the mean loss over this rank's
    micro-batches per step (the test averages over ranks), grad norms and the full parameters."""
    from zero_core import ZeroConfig, ZeroRuntime

    world, rank = dist.get_world_size(), dist.get_rank()
    gas = spec.get("gas", 1)
    model = build(spec.get("model", "tiny"), **spec.get("model_kw", {}))
    if rank != 0:  # prove the runtime broadcasts rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = make_optimizer(spec.get("optimizer", "adamw"), param_groups(model, spec.get("groups", "one")))
    zero = dict(spec.get("zero", {}))
    if spec["stage"] == 3:  # nothing stays resident unless the spec says so: every unit is gathered and released
        zero.setdefault("stage3_param_persistence_threshold", 0)
    cfg = ZeroConfig(stage=spec["stage"], **zero)
    rt = ZeroRuntime(model, opt, cfg, precision_of(spec.get("precision", "fp32")), gradient_clipping=spec.get("clip")
                     or 0.0)  # fmt: skip
    losses, norms = [], []
    for step in range(spec.get("steps", 3)):
        x, y = batch(step, world, gas)
        micro = x.shape[0] // gas
        total = 0.0
        for k in range(gas):
            lo = k * micro + rank * MICRO_PER_RANK
            xs, ys = x[lo : lo + MICRO_PER_RANK], y[lo : lo + MICRO_PER_RANK]
            loss = F.cross_entropy(rt.module(xs), ys)
            rt.backward(loss / gas, is_boundary=(k == gas - 1) if spec.get("boundary", True) else None)
            total += loss.item() / gas
        res = rt.step()
        losses.append(total)
        norms.append(res.grad_norm)
    return {"losses": losses, "norms": norms, "params": rt.full_parameters()}
