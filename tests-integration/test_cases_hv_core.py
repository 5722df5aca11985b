"""Reads outside the module, structured stage-3 outputs and changing ``requires_grad``, each with the variants a user
can meet, against a single-process PyTorch reference fed the whole global batch (2 ranks x micro-batch 4, gloo).

* Reads outside the module (stages 1/2, ``overlap_comm``): a parameter read outside its module's forward sees the
  stepped values: read by another module's forward (the case), by the loss, by user code between steps (an EMA teacher),
  through ``state_dict()``; fp32 and fp16 (static loss scale 1); equal to the ``overlap_comm: false`` run.
* Structured outputs (stage 3): parameter-owning modules returning a dataclass (the case), a named tuple, a dataclass
  nested in a dict in a list, a ``transformers`` ``ModelOutput``; an unknown container holding tensors is a clear error
  naming the module and the type.
* Changing ``requires_grad`` (stages 0-3): turned on after the engine is built (the case) and off again; a parameter
  with no gradient in a step (frozen for now, or unused) is not moved by momentum or weight decay, and Adam's
  bias correction of a parameter first trained at step 3 starts from 1, as torch's per-parameter ``step``.
"""

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, UnknownOutputError, ZeroConfig, ZeroRuntime

WORLD = 2


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * 4, 6, generator=g), torch.randint(0, 3, (WORLD * 4,), generator=g)


# --------------------------------------------------------------------------------------------- reads outside the module
class ReadsOutside(nn.Module):
    """The case: ``conv1d`` is owned here but never called; its weight is read directly (Megatron PR #4467)."""

    def __init__(self):
        super().__init__()
        self.conv1d = nn.Linear(384, 384)
        self.head = nn.Linear(384, 3)

    def forward(self, x, how):
        if how == "loss":  # variant: the module is called, the loss reads its weight again
            h = torch.tanh(self.conv1d(x))
        else:
            h = torch.tanh(F.linear(x, self.conv1d.weight, self.conv1d.bias))
        return self.head(h)


def _outside_read_data(step):
    g = torch.Generator().manual_seed(900 + step)
    return torch.randn(WORLD * 4, 384, generator=g), torch.randint(0, 3, (WORLD * 4,), generator=g)


def _outside_read_loss(model, x, y, how):
    loss = F.cross_entropy(model(x, how), y)
    if how == "loss":
        loss = loss + 1e-3 * model.conv1d.weight.square().sum()
    return loss


def _outside_read_reference(how, steps=4):
    torch.manual_seed(0)
    model = ReadsOutside()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, reads = [], []
    for step in range(steps):
        x, y = _outside_read_data(step)
        loss = _outside_read_loss(model, x, y, how)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        reads.append(model.conv1d.weight.detach().sum().item())
    return losses, reads


def _outside_read_body(stage, overlap, fp16, how, steps=4):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = ReadsOutside()
    cfg = ZeroConfig(stage=stage, overlap_comm=overlap, reduce_bucket_size=40_000)  # several buckets
    precision = PrecisionPolicy.fp16() if fp16 else PrecisionPolicy.fp32()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.5), cfg, precision)
    dtype = torch.float16 if fp16 else torch.float32
    losses, reads = [], []
    for step in range(steps):
        x, y = _outside_read_data(step)
        xs, ys = x[rank * 4 : rank * 4 + 4].to(dtype), y[rank * 4 : rank * 4 + 4]
        loss = _outside_read_loss(rt.module, xs, ys, how).float()
        rt.backward(loss)
        rt.step()
        # user code between steps (an EMA teacher) and state_dict() read the weight right after step()
        read = model.conv1d.weight.detach().float().sum().item()
        via_state = model.state_dict()["conv1d.weight"].float().sum().item()
        reads.append((read, via_state))
        out = torch.tensor([loss.item()])
        dist.all_reduce(out)
        losses.append(out.item() / WORLD)
    return losses, reads, len(rt.flat_groups[0].buckets)


@pytest.mark.parametrize("how", ["outside", "loss"])
@pytest.mark.parametrize("stage", [1, 2])
def test_reads_outside_the_module_see_stepped_weights(stage, how):
    ref_losses, ref_reads = _outside_read_reference(how)
    runs = {}
    for overlap in (True, False):
        for fp16 in (False, True):
            runs[overlap, fp16] = run_ranks(_outside_read_body, WORLD, stage, overlap, fp16, how, timeout=180)
    for (overlap, fp16), outs in runs.items():
        tol = dict(rel=3e-3, abs=3e-3) if fp16 else dict(rel=1e-5, abs=1e-6)
        for losses, reads, buckets in outs:
            assert buckets > 1
            assert losses == pytest.approx(ref_losses, **tol), (overlap, fp16)
            rtol = dict(rel=1e-2, abs=0.5) if fp16 else dict(rel=1e-5, abs=1e-4)
            assert [r for r, _ in reads] == pytest.approx(ref_reads, **rtol)
            assert [s for _, s in reads] == pytest.approx(ref_reads, **rtol)
    for fp16 in (False, True):  # overlap_comm changes nothing
        assert runs[True, fp16][0][0] == runs[False, fp16][0][0]


# ------------------------------------------------------------------------------------------- structured stage-3 outputs
@dataclasses.dataclass
class EncOut:
    hidden: torch.Tensor
    extra: torch.Tensor


class EncPair(NamedTuple):
    hidden: torch.Tensor
    extra: torch.Tensor


class Opaque:
    """A container pytree does not know, holding tensors."""

    def __init__(self, hidden, extra):
        self.hidden, self.extra = hidden, extra


def _wrap(kind, hidden, extra):
    if kind == "dataclass":
        return EncOut(hidden, extra)
    if kind == "namedtuple":
        return EncPair(hidden, extra)
    if kind == "nested":
        return [{"out": EncOut(hidden, extra), "n": 3}, None]
    if kind == "modeloutput":
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=hidden, hidden_states=(extra,))
    return Opaque(hidden, extra)


def _unwrap(kind, out):
    if kind in ("dataclass", "namedtuple"):
        return out.hidden, out.extra
    if kind == "nested":
        return out[0]["out"].hidden, out[0]["out"].extra
    if kind == "modeloutput":
        return out.last_hidden_state, out.hidden_states[0]
    return out.hidden, out.extra


class Encoder(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(16, 16) * 0.3)
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x):
        hidden = torch.tanh(F.linear(x, self.weight, self.bias))
        return _wrap(self.kind, hidden, hidden.sum(-1))


class EncNet(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(6, 16)
        self.enc = Encoder(kind)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        hidden, extra = _unwrap(self.kind, self.enc(self.inp(x)))
        return self.out(hidden), extra


def _structured_output_loss(model, x, y):
    logits, extra = model(x)
    return F.cross_entropy(logits, y) + 0.01 * extra.pow(2).mean()


def _structured_output_reference(kind, steps=3):
    torch.manual_seed(0)
    model = EncNet(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = _structured_output_loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _structured_output_body(kind, prefetch, steps=3):
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = EncNet(kind)
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=prefetch)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.2), cfg)
    losses = []
    try:
        for step in range(steps):
            x, y = _batch(step)
            loss = _structured_output_loss(rt.module, x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4])
            rt.backward(loss)
            rt.step()
            out = torch.tensor([loss.item()])
            dist.all_reduce(out)
            losses.append(out.item() / WORLD)
    except UnknownOutputError as exc:
        return str(exc)
    return losses


@pytest.mark.parametrize("kind", ["dataclass", "namedtuple", "nested", "modeloutput"])
def test_stage3_module_outputs_of_any_structure(kind):
    ref = _structured_output_reference(kind)
    for prefetch in (50_000_000, 1):  # default prefetch and (nearly) none
        for losses in run_ranks(_structured_output_body, WORLD, kind, prefetch, timeout=120):
            assert losses == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_stage3_unknown_output_container_is_named():
    for msg in run_ranks(_structured_output_body, WORLD, "opaque", 50_000_000, timeout=120):
        assert isinstance(msg, str)
        assert "module Encoder" in msg and "Opaque" in msg and "register_pytree_node" in msg


# ----------------------------------------------------------------------------------------------- changing requires_grad
class Net3(nn.Module):
    """cases-2.md's Net3, plus ``extra`` (Linear(3,3)) that ``forward`` uses only when asked (unused variant)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.extra = nn.Linear(3, 3)

    def forward(self, x, use_extra):
        out = self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))
        return self.extra(out) if use_extra else out


# variant -> (weight_decay, {step: [(module, requires_grad)]} applied before that step, steps using `extra`)
FREEZE_VARIANTS = {
    "unfreeze": (0.0, {2: [("l1", True)]}, range(5)),  # the case: l1 frozen before initialize, trained from step 3
    "refreeze": (0.1, {1: [("l2", False)], 3: [("l2", True)]}, range(5)),  # frozen for two steps, then again
    "unused": (0.1, {}, (0, 3)),  # `extra` gets no gradient at steps 2, 3 and 5: not moved by decay or momentum
}


def _freeze_run(model, variant, step_fn):
    wd, changes, used = FREEZE_VARIANTS[variant]
    snapshots = []
    for step in range(5):
        for name, flag in changes.get(step, []):
            getattr(model, name).requires_grad_(flag)
        step_fn(step, step in used)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snapshots


def _freeze_model(variant):
    torch.manual_seed(0)
    model = Net3()
    if variant == "unfreeze":
        model.l1.requires_grad_(False)
    wd = FREEZE_VARIANTS[variant][0]
    return model, torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=wd)  # every parameter, as the case


def _freeze_reference(variant):
    model, opt = _freeze_model(variant)

    def step_fn(step, use_extra):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, use_extra), y).backward()
        opt.step()

    return _freeze_run(model, variant, step_fn)


def _freeze_body(variant, stage):
    import torch.distributed as dist

    rank = dist.get_rank()
    model, opt = _freeze_model(variant)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=70, stage3_param_persistence_threshold=0))

    def step_fn(step, use_extra):
        x, y = _batch(step)
        rt.backward(F.cross_entropy(rt.module(x[rank * 4 : rank * 4 + 4], use_extra), y[rank * 4 : rank * 4 + 4]))
        rt.step()

    snapshots = _freeze_run(model, variant, step_fn)
    return rt.full_parameters(), snapshots if stage < 3 else None  # stage 3: parameters are released between steps


@pytest.mark.parametrize("variant", list(FREEZE_VARIANTS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_requires_grad_changes_and_params_without_grad_are_skipped(variant, stage):
    ref = _freeze_reference(variant)
    for final, every in run_ranks(_freeze_body, WORLD, variant, stage, timeout=180):
        for name, want in ref[-1].items():
            torch.testing.assert_close(final[name], want, rtol=1e-5, atol=1e-6, msg=f"{variant} stage {stage} {name}")
        if every is not None:  # stages 0-2: the module's parameters after every step
            for step, (got, want) in enumerate(zip(every, ref)):
                for name in want:
                    torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                               msg=f"{variant} stage {stage} step {step + 1} {name}")  # fmt: skip


def _unfreeze_outside_optimizer_body():
    torch.manual_seed(0)
    model = Net3()
    model.l1.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    model.l1.requires_grad_(True)
    try:
        rt.backward(F.cross_entropy(rt.module(torch.ones(4, 6), False), torch.zeros(4, dtype=torch.long)))
    except ValueError as exc:
        return str(exc)
    return None


def test_stage3_unfreezing_a_parameter_outside_the_optimizer_is_named():
    """The direction stage 3 cannot honour: a parameter in no optimizer group has no gradient buffer."""
    for msg in run_ranks(_unfreeze_outside_optimizer_body, WORLD, timeout=120):
        assert msg is not None and "'l1.weight'" in msg and "no optimizer param group" in msg
