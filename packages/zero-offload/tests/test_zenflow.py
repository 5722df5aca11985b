"""ZenFlow (``zero_optimization.zenflow``) on 2 gloo ranks at stages 1 and 2.

* With every column selected once and a host update every step it is ZeRO-Offload bitwise (losses, parameters,
  Adam state); the device step is not clipped (DeepSpeed's selective optimizer steps the gradients before
  clipping), so ZenFlow with ``gradient_clipping`` 0.5 equals ZeRO-Offload without clipping. ``update_interval``
  "auto" with ``auto_ratio`` 0 (every step asks for the host update) equals ``update_interval`` 1 bitwise.
* On one Linear layer (its weight split mid-row between the ranks), the parameters after 9 steps equal a
  single-process reference of DeepSpeed's rule written out below (fp32, 1e-6), with and without ``overlap_step``,
  with clipping that binds: device moments zeroed at each re-selection and bias-corrected at the count of device
  steps, the host stepping the sum of the gradients divided by ``update_interval`` clipped by its own norm, warm-up
  steps divided by it too, selections every ``select_interval`` steps counted from step 1 and update boundaries on
  the grid counted from the end of warm-up. The recorded host updates show the staleness bound: applied at once
  without overlap, at the next boundary with it (earlier when a re-selection comes first).
* A checkpoint taken while a host step is in flight loads bitwise into ZenFlow and into plain ZeRO-Offload; a
  resumed ZenFlow run goes on from the saved step count and selects its columns afresh.
* Without clipping, one column per matrix on the device with a host update every step is ZeRO-Offload bitwise;
  every column on the device with a host update every 4 steps is ZeRO-Offload up to Adam's eps.
"""

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import load_checkpoint, save_checkpoint
from zero_offload import OffloadMaster, ZenFlowMaster, master_store_for

LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 7)
        self.head = nn.Linear(7, 11, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.emb(x))))


def _runtime(model_cls, stage, zenflow, clip=0.0, bucket=40):
    torch.manual_seed(0)
    model = model_cls()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS, eps=EPS)
    section = {"stage": stage, "reduce_bucket_size": bucket, "overlap_comm": stage == 2,
               "offload_optimizer": {"device": "cpu"}}  # fmt: skip
    if zenflow is not None:
        section["zenflow"] = zenflow
    cfg = ZeroConfig.model_validate(section)
    master = master_store_for(cfg, model, dist.get_world_size(), dist.get_rank())
    rt = ZeroRuntime(model, opt, cfg, PrecisionPolicy.fp32(), gradient_clipping=clip, master_store=master)
    assert isinstance(rt.master, ZenFlowMaster) == (zenflow is not None) and isinstance(rt.master, OffloadMaster)
    return rt


def _train_net(rt, steps):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randint(0, 11, (4, 5), generator=g)
        loss = nn.functional.cross_entropy(rt.module(x).flatten(0, 1), x.flatten())
        rt.backward(loss, is_boundary=True)
        rt.step()
        losses.append(loss.item())
    return losses


def _state(rt):
    out = dict(rt.full_parameters())
    for g in rt.flat_groups:
        if g.group_index is not None:
            for k, v in rt.master.state_shard(g).items():
                out[f"state/{g.index}/{k}"] = torch.as_tensor(v).clone()
    return out


def _bitwise(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


# ---------------------------------------------------------------- the single-process reference of the rule
def _adamw(p, g, m, v, step):
    """torch.optim.AdamW's formula on plain tensors (in place)."""
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


class Reference:
    """DeepSpeed's ZenFlow rule on whole tensors, one process: ``P`` what the model holds, ``H``/``Hm``/``Hv`` the
    host master and moments, ``Dm``/``Dv`` the device moments (meaningful on the selection ``S``). Gradients are
    divided by ``update_every`` (DeepSpeed's gradient accumulation steps); the host clips what it steps by its
    norm, the device steps unclipped at its own step count."""

    def __init__(self, params, topk, select_every, update_every, warm, overlap, clip):
        self.P = {k: v.clone() for k, v in params.items()}
        self.H = {k: v.clone() for k, v in params.items()}
        self.Hm = {k: torch.zeros_like(v) for k, v in params.items()}
        self.Hv = {k: torch.zeros_like(v) for k, v in params.items()}
        self.Dm = {k: torch.zeros_like(v) for k, v in params.items()}
        self.Dv = {k: torch.zeros_like(v) for k, v in params.items()}
        self.acc = {k: torch.zeros_like(v) for k, v in params.items()}
        self.S = {k: torch.zeros_like(v, dtype=torch.bool) for k, v in params.items()}
        self.topk, self.every, self.U, self.W, self.overlap = topk, select_every, update_every, warm, overlap
        self.clip, self.clipped = clip, 0  # host steps whose gradient the clip scaled down
        self.t, self.window, self.pending, self.trace = 0, 0, None, []

    def _selects(self, t):
        return t - 1 >= self.W and (t - 1 == self.W or (t - 1) % self.every == 0)

    def _clip_factor(self, grads):
        norm = sum(g.double().square().sum() for g in grads.values()).sqrt().item()
        factor = min(1.0, self.clip / (norm + 1e-6))
        self.clipped += factor < 1.0
        return factor

    def _apply(self, update):
        for k in self.P:
            self.P[k] = torch.where(self.S[k], self.P[k], self.H[k])
        self.trace.append((*update, self.t))

    def step(self, grads):
        self.t = t = self.t + 1
        grads = {k: g / self.U for k, g in grads.items()}
        if t <= self.W:
            f = self._clip_factor(grads)
            for k, g in grads.items():
                _adamw(self.H[k], g * f, self.Hm[k], self.Hv[k], t)
                self.P[k] = self.H[k].clone()
            self.trace.append((t, t, t, t))
            return
        if self._selects(t):
            if self.pending:
                self._apply(self.pending)
                self.pending = None
            for k, g in grads.items():  # the old selection's values go back to the host; new moments are zero
                self.H[k] = torch.where(self.S[k], self.P[k], self.H[k])
                keep = torch.ones_like(g, dtype=torch.bool)
                if g.dim() == 2:
                    cols = g.abs().sum(0)
                    keep = torch.zeros_like(cols, dtype=torch.bool)
                    keep[torch.topk(cols, max(1, int(cols.numel() * self.topk))).indices] = True
                    keep = keep.expand_as(g).clone()
                self.S[k] = keep
                self.Dm[k], self.Dv[k] = torch.zeros_like(g), torch.zeros_like(g)
        for k, g in grads.items():
            p, m, v = self.P[k].clone(), self.Dm[k].clone(), self.Dv[k].clone()
            _adamw(p, g, m, v, t - self.W)
            s = self.S[k]
            self.P[k] = torch.where(s, p, self.P[k])
            self.Dm[k], self.Dv[k] = torch.where(s, m, self.Dm[k]), torch.where(s, v, self.Dv[k])
            self.acc[k] += g
        self.window += 1
        if (t - self.W) % self.U == 0 or t % self.every == 0:
            update = (t - self.window + 1, t, t)
            if self.overlap and self.pending:  # the host step in flight lands first
                self._apply(self.pending)
            f = self._clip_factor(self.acc)
            for k in self.H:  # bias correction at the step count, not the count of host updates
                _adamw(self.H[k], self.acc[k] * f, self.Hm[k], self.Hv[k], t)
                self.acc[k].zero_()
            self.window = 0
            if self.overlap:
                self.pending = update  # its values reach P at the next boundary or selection
            else:
                self._apply(update)


def _linear_data(step, rank):
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 6, generator=g)


def _check_rule(stage, overlap):
    """9 steps of one Linear(8, 6) against the reference; the host-update trace is asserted exactly."""
    zen = {"topk_ratio": 0.5, "select_strategy": "step", "select_interval": 4, "update_interval": 2,
           "full_warm_up_rounds": 1, "overlap_step": overlap}  # fmt: skip
    rt = _runtime(lambda: nn.Linear(8, 6), stage, zen, clip=0.3, bucket=1000)
    torch.manual_seed(0)
    ref_model = nn.Linear(8, 6)
    ref = Reference(dict(ref_model.named_parameters()), 0.5, 4, 2, 1, overlap, 0.3)
    for step in range(9):
        x, y = _linear_data(step, dist.get_rank())
        rt.backward(nn.functional.mse_loss(rt.module(x), y), is_boundary=True)
        rt.step()
        with torch.no_grad():
            for k, v in ref_model.named_parameters():
                v.copy_(ref.P[k])
        grads = {k: torch.zeros_like(v) for k, v in ref.P.items()}
        for r in range(dist.get_world_size()):  # ZeRO's gradient: the mean over ranks
            ref_model.zero_grad()
            nn.functional.mse_loss(ref_model(_linear_data(step, r)[0]), _linear_data(step, r)[1]).backward()
            for k, v in ref_model.named_parameters():
                grads[k] += v.grad / dist.get_world_size()
        ref.step(grads)
    got = rt.full_parameters()
    for k in ref.P:
        torch.testing.assert_close(got[k], ref.P[k], rtol=1e-6, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    trace = [(u.first, u.last, u.launched, u.applied) for u in rt.master.trace]
    assert trace == ref.trace, (trace, ref.trace)
    # boundaries at 3, 5, 7, 9 (every 2 steps after the warm-up step) and at 4, 8 (before the re-selections)
    if overlap:  # each lands at the next boundary, or at the re-selection (5, 9) when that comes first
        assert trace == [(1, 1, 1, 1), (2, 3, 3, 4), (4, 4, 4, 5), (5, 5, 5, 7), (6, 7, 7, 8), (8, 8, 8, 9)], trace
    else:
        assert trace == [(1, 1, 1, 1), (2, 3, 3, 3), (4, 4, 4, 4), (5, 5, 5, 5), (6, 7, 7, 7), (8, 8, 8, 8),
                         (9, 9, 9, 9)], trace  # fmt: skip
    assert all(u.applied - u.last <= 2 for u in rt.master.trace)  # no host update lags more than update_interval
    assert rt.master.selections == [2, 5, 9]  # after warm-up, then where (t - 1) % select_interval == 0
    assert ref.clipped >= 3, ref.clipped  # the clip binds, so clipping what and where is asserted
    # half of the weight's columns are on the device
    assert ref.S["weight"].sum() == 24 and not ref.S["weight"].all()
    rt.close()


def _check_checkpoint(root):
    """A checkpoint taken with a host step in flight holds the parameters and Adam state as the model sees them;
    a ZenFlow run and a plain ZeRO-Offload run load them bitwise."""
    zen = {"topk_ratio": 0.5, "select_strategy": "step", "select_interval": 8, "update_interval": 2,
           "overlap_step": True}  # fmt: skip
    rt = _runtime(Net, 2, zen)
    _train_net(rt, 3)
    flight = rt.master.in_flight  # launched at step 2, lands at step 4
    assert (flight.first, flight.last, flight.launched, flight.applied) == (1, 2, 2, None)
    save_checkpoint(rt, root, "zen")
    saved = _state(rt)
    for other in (_runtime(Net, 2, zen), _runtime(Net, 2, None)):
        load_checkpoint(other, root, "zen")
        _bitwise(_state(other), saved, f"load into {type(other.master).__name__}")
        if isinstance(other.master, ZenFlowMaster):  # the step count goes on; columns are selected afresh
            _train_net(other, 2)
            assert (other.master.steps, other.master.selections) == (5, [4]), other.master.selections
            flight = other.master.in_flight  # launched at the boundary of step 4, (t - 0) % 2 == 0
            assert other.master.trace == [] and (flight.first, flight.last, flight.launched) == (4, 4, 4)
        other.close()
    assert float(saved["state/0/step"]) == 3.0 and rt.master.selections == [1]
    rt.close()


def _check_split(stage):
    """Without clipping and with columns selected once, splitting the work between the device and the host loses
    nothing: one column per matrix on the device and a host update every step is ZeRO-Offload bitwise; every column
    on the device with a host update every 4 steps is ZeRO-Offload up to Adam's eps (the gradients are divided by
    4), so no host value reaches a selected element."""
    once = {"select_strategy": "epoch", "select_interval": 1}
    plain = _runtime(Net, stage, None)
    few = _runtime(Net, stage, {**once, "topk_ratio": 0.1, "update_interval": 1})
    every = _runtime(Net, stage, {**once, "topk_ratio": 1.0, "update_interval": 4})
    lp = _train_net(plain, 5)
    assert _train_net(few, 5) == lp, f"stage {stage} losses, one column per matrix on the device"
    _bitwise(_state(few), _state(plain), f"stage {stage} zenflow topk 0.1")
    assert few.master.selections == [1] and len(few.master.trace) == 5  # selected once, a host update per step
    torch.testing.assert_close(_train_net(every, 5), lp, rtol=1e-5, atol=1e-5)
    want = plain.full_parameters()
    for k, v in every.full_parameters().items():
        torch.testing.assert_close(v, want[k], rtol=0, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    assert len(every.master.trace) == 1  # one host update (step 4), none of whose values reached the parameters
    for rt in (plain, few, every):
        rt.close()


def _zenflow_body(root):
    _check_checkpoint(root)
    for stage in (1, 2):
        plain = _runtime(Net, stage, None)
        # every column on the device, selected once (an epoch strategy without steps_per_epoch)
        every = {"topk_ratio": 1.0, "update_interval": 1, "select_strategy": "epoch", "select_interval": 1}
        zen = _runtime(Net, stage, every, clip=0.5)
        half = {**every, "topk_ratio": 0.5, "select_strategy": "step", "select_interval": 2,
                "offload": stage == 2}  # stage 2: selected moments kept on the host  # fmt: skip
        each = _runtime(Net, stage, half, clip=0.5)
        auto = _runtime(Net, stage, {**half, "update_interval": "auto", "auto_ratio": 0.0}, clip=0.5)
        lp = _train_net(plain, 5)
        assert _train_net(zen, 5) == lp, f"stage {stage} losses"
        _bitwise(_state(zen), _state(plain), f"stage {stage} zenflow topk 1")
        assert zen.master.selections == [1] and len(zen.master.trace) == 5
        # "auto" with auto_ratio 0 asks for the host update every step: update_interval 1 bitwise
        le = _train_net(each, 5)
        assert _train_net(auto, 5) == le and le != lp, f"stage {stage} losses"
        _bitwise(_state(auto), _state(each), f"stage {stage} zenflow auto")
        assert len(auto.master.trace) == 5 and auto.master.selections == [1, 3, 5]
        for rt in (plain, zen, each, auto):
            rt.close()
        _check_split(stage)
        for overlap in (False, True):
            _check_rule(stage, overlap)


def test_zenflow_equals_offload_and_follows_the_rule(tmp_path):
    run_ranks(_zenflow_body, 2, str(tmp_path), timeout=240, threads=1)
