"""Shared reference models, data and training loops for the parity tests (cases.md conventions).

``reference_run`` trains a plain single-process fp32 copy on the whole global batch (mean loss); ``sharded_run``
runs on a rank (inside ``run_ranks``) through ``zero_core.ZeroRuntime`` with rank r taking slice r of every
micro-batch. Both return per-step losses, grad norms and the final full parameters so tests compare values.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SEED = 1234
MICRO_PER_RANK = 3


class TinyNet(nn.Module):
    """Linear(8,13) -> GELU -> Linear(13,7) -> GELU -> Linear(7,4): 247 elements (= 13 x 19), no world size
    divides it. ``extra``: an optional Linear(4,4) head (sometimes unused); ``noncontig``: layer-2 weight a
    transposed view."""

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


class TiedNet(nn.Module):
    """Embedding(13,6) whose weight is the same Parameter as the output Linear(6,13,bias=False)'s; vocab 13."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))


class ConvTiny(TinyNet):
    """TinyNet with a non-contiguous layer-2 weight plus a channels_last Conv2d(3,4,3) branch on a fixed (2,3,5,5)
    input whose per-channel means are added to the 4 logits."""

    def __init__(self):
        super().__init__(noncontig=True)
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv.weight = nn.Parameter(self.conv.weight.detach().to(memory_format=torch.channels_last))
        self.register_buffer("z", torch.linspace(0.1, 1, 150).view(2, 3, 5, 5))

    def forward(self, x):
        return super().forward(x) + self.conv(self.z).mean(dim=(0, 2, 3))  # one pooled value per class


class TinyPlus(TinyNet):
    """TinyNet plus a 3-element Parameter ``v`` (its own param group: smaller than the world size) that offsets three
    logits."""

    def __init__(self):
        super().__init__()
        self.v = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return super().forward(x) + torch.cat([self.v, self.v.new_zeros(1)])


MODELS = {"tiny": TinyNet, "tied": TiedNet, "conv": ConvTiny, "plus": TinyPlus}


def build(model: str = "tiny", **kw) -> nn.Module:
    """The model named ``model`` built from ``SEED`` (identical on every process)."""
    torch.manual_seed(SEED)
    return MODELS[model](**kw)


def batch(step: int, world: int, gas: int, model: str = "tiny"):
    """The global batch of optimizer step ``step``, N = 3*world*gas samples: TinyNet (x [N, 8] in [-1, 1], y [N]
    in [0, 4)); TiedNet (token ids [N] and targets [N] in [0, 13))."""
    g = torch.Generator().manual_seed(1000 + step)
    n = MICRO_PER_RANK * world * gas
    if model == "tied":
        return torch.randint(0, 13, (n,), generator=g), torch.randint(0, 13, (n,), generator=g)
    return torch.rand(n, 8, generator=g) * 2 - 1, torch.randint(0, 4, (n,), generator=g)


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
    if split == "plus":  # a group smaller than the world size
        return [{"params": [p for n, p in model.named_parameters() if n != "v"]}, {"params": [model.v]}]
    if split == "lr":  # per-group lr / weight decay, G2 frozen in effect (lr 0)
        return [
            {"params": list(model.l1.parameters()), "lr": 1e-2, "weight_decay": 0.1},
            {"params": list(model.l2.parameters()), "lr": 1e-3, "weight_decay": 0.0},
            {"params": list(model.l3.parameters()), "lr": 0.0, "weight_decay": 0.0},
        ]
    raise ValueError(split)


def reference_run(spec: dict) -> dict:
    """Single-process fp32 training on the global batch; same keys as ``sharded_run``'s result."""
    model = build(spec.get("model", "tiny"), **spec.get("model_kw", {}))
    opt = make_optimizer(
        spec.get("optimizer", "adamw"), param_groups(model, spec.get("groups", "one")), **spec.get("opt_kw", {})
    )
    losses, norms = [], []
    world, gas = spec["world"], spec.get("gas", 1)
    grads = None
    for step in range(spec.get("steps", 3)):
        _per_step(spec, model, opt, step)
        x, y = batch(step, world, gas, spec.get("model", "tiny"))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.get("clip") or float("inf"))))
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "grads": grads}


def _per_step(spec: dict, model: nn.Module, opt, step: int) -> None:
    """Per-step changes shared by both runs: when ``extra`` is used; an lr edit as a scheduler would."""
    when = spec.get("extra_when")
    if when is not None:
        model.use_extra = when == "always" or (when == "even" and step % 2 == 0)
    change = spec.get("lr_change")
    if change is not None and step == change[0]:
        opt.param_groups[change[1]]["lr"] = change[2]


def precision_of(name: str):
    """``fp32`` or ``bf16`` (bf16 storage and communication, fp32 compute, master and accumulation)."""
    from zero_core import PrecisionPolicy

    return PrecisionPolicy() if name == "fp32" else PrecisionPolicy.bf16()


def sharded_run(spec: dict) -> dict:
    """On one rank: build, wrap in ZeroRuntime per ``spec`` and train; returns the mean loss over this rank's
    micro-batches per step (the test averages over ranks), grad norms and the full parameters."""
    from zero_core import ZeroConfig, ZeroRuntime
    from zero_core.reducer import GradReducer

    world, rank = dist.get_world_size(), dist.get_rank()
    gas = spec.get("gas", 1)
    model = build(spec.get("model", "tiny"), **spec.get("model_kw", {}))
    if rank != 0:  # prove the runtime broadcasts rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = make_optimizer(
        spec.get("optimizer", "adamw"), param_groups(model, spec.get("groups", "one")), **spec.get("opt_kw", {})
    )
    zero = dict(spec.get("zero", {}))
    if spec["stage"] == 3:  # nothing stays resident unless the spec says so: every unit is gathered and released
        zero.setdefault("stage3_param_persistence_threshold", 0)
    cfg = ZeroConfig(stage=spec["stage"], **zero)
    # piece_bytes: stages 0-2 reduce each bucket in pieces of at most this many bytes (DDP-sized buckets)
    reducer = functools.partial(GradReducer.from_inputs, piece_bytes=spec["piece_bytes"]) if "piece_bytes" in spec \
        else None  # fmt: skip
    rt = ZeroRuntime(model, opt, cfg, precision_of(spec.get("precision", "fp32")), gradient_clipping=spec.get("clip")
                     or 0.0, grad_reduction=reducer)  # fmt: skip
    out = {"init": rt.full_parameters()} if spec.get("check_init") else {}
    losses, norms, released = [], [], []
    for step in range(spec.get("steps", 3)):
        _per_step(spec, model, rt.optimizer, step)
        x, y = batch(step, world, gas, spec.get("model", "tiny"))
        micro = x.shape[0] // gas
        total = 0.0
        for k in range(gas):
            lo = k * micro + rank * MICRO_PER_RANK
            xs, ys = x[lo : lo + MICRO_PER_RANK], y[lo : lo + MICRO_PER_RANK]
            loss = F.cross_entropy(rt.module(xs), ys)
            rt.backward(loss / gas, is_boundary=(k == gas - 1) if spec.get("boundary", True) else None)
            total += loss.item() / gas
            released.append(all_released(rt))
        if spec.get("return_grads") and step == 0:  # the library's gradient accessor, before the first step
            out["grads"] = {n: rt.full_grad(p) for n, p in model.named_parameters()}
        res = rt.step()
        losses.append(total)
        norms.append(res.grad_norm)
    out.update(losses=losses, norms=norms, params=rt.full_parameters(), released=released)
    out["lrs"] = [g["lr"] for g in rt.optimizer.param_groups]
    if spec.get("return_shards"):  # what each rank owns: (names, shard_ranges, master shard) per flat group
        masters = [rt.master.master_shard(g) for g in rt.flat_groups]
        out["shards"] = [(g.names, g.shard_ranges(), m.detach().clone()) for g, m in zip(rt.flat_groups, masters)]
    return out


def all_released(rt) -> bool:
    """Stage 3: every non-persistent unit is back in the SHARDED state (vacuously True at stages 0-2)."""
    from zero_core import ShardState

    return rt.stage < 3 or all(
        b.persistent or rt.params.state_of(b) is ShardState.SHARDED for g in rt.flat_groups for b in g.buckets
    )
