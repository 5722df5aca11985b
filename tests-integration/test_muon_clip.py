"""MuonClip (Muon's ``qk_clip_threshold``, Kimi K2's QK-clip) against a single-process reference of the rule.

The rule, written here from the K2 report and not from the code under test: after the step, every head ``h`` whose
largest logit of the step ``S_h`` exceeds ``tau`` gets ``gamma_h = tau / S_h``; with its own key head the query and
key rows of ``h`` are multiplied by ``sqrt(gamma_h)``, with a key head shared by several query heads (grouped-query)
the query rows by ``gamma_h`` and the key left alone. So the clipped head's logits on the same input scale by
``gamma_h`` exactly and its largest one becomes ``tau`` (checked, rtol 1e-5); other heads keep their weights.

Standalone: Muon with the clip equals a plain Muon step followed by the rule (rtol 1e-6: the same update, then
factors computed here in float64, there in fp32). Through ``zero.initialize`` at stages 2 and 3 on 2 gloo ranks,
each rank seeing its half of the batch and reporting its own maxima: equal to a single-process Muon with the clip on
the whole batch (the maxima over both halves), fp32, rtol 1e-5 / atol 1e-6 after 3 steps, with heads clipped on the
way; at stage 2 the key weight straddles the two ranks' shards.
"""

import math

import pytest
import torch
import torch.distributed as dist

import zero
from zero.config import ConfigError, load_config
from zero.optim.muon import Muon
from zero_comm.testing import run_ranks

D, HEADS, HEAD_DIM, T = 16, 4, 4, 6
TAU = 5.0  # the first batch: heads 0, 1 exceed it (5.73, 7.54), heads 2, 3 do not; grouped-query: head 0 alone
# the engine test: on rank 0's half of the first batch head 2 peaks at 3.47, on rank 1's at 3.91; the query rows of
# head 2 lie in rank 0's shard at stage 2, so only the maxima agreed over the ranks clip them as the reference does
TAU_ENGINE = 3.7


class Attention(torch.nn.Module):
    """Self-attention without biases that records each head's largest logit of its last forward."""

    def __init__(self, kv_heads=HEADS):
        super().__init__()
        self.kv = kv_heads
        # first, so that at stage 2 the 2 ranks' shard boundary (element 640 of 1280) cuts the key weight in two
        self.inp = torch.nn.Linear(D, D, bias=False)
        self.q = torch.nn.Linear(D, HEADS * HEAD_DIM, bias=False)
        self.k = torch.nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.v = torch.nn.Linear(D, kv_heads * HEAD_DIM, bias=False)
        self.o = torch.nn.Linear(HEADS * HEAD_DIM, D, bias=False)
        self.max_logits = torch.zeros(HEADS)

    def logits(self, x):
        b = x.shape[0]
        x = self.inp(x)
        q = self.q(x).view(b, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(b, T, self.kv, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // self.kv, dim=1)
        return q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)

    def forward(self, x):
        b = x.shape[0]
        att = self.logits(x)
        self.max_logits = att.detach().amax(dim=(0, 2, 3))
        v = self.v(self.inp(x)).view(b, T, self.kv, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // self.kv, dim=1)
        return self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(b, T, HEADS * HEAD_DIM))


def _model(kv=HEADS):
    torch.manual_seed(11)
    m = Attention(kv)
    with torch.no_grad():
        m.q.weight.mul_(4.0)  # large logits, so heads exceed tau
        m.k.weight.mul_(4.0)
    return m


def _batch(step, rows):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(rows, T, D, generator=g), torch.randn(rows, T, D, generator=g)


def _rule(model, s_max):
    """The K2 rule by hand on ``model``'s weights for per-head maxima ``s_max``; the heads clipped."""
    clipped = []
    with torch.no_grad():
        for h in range(HEADS):
            if s_max[h] > TAU:
                gamma = TAU / s_max[h]
                rows = slice(h * HEAD_DIM, (h + 1) * HEAD_DIM)
                if model.kv == HEADS:
                    model.q.weight[rows] *= math.sqrt(gamma)
                    model.k.weight[rows] *= math.sqrt(gamma)
                else:
                    model.q.weight[rows] *= gamma
                clipped.append(h)
    return clipped


def test_standalone_clip_is_a_muon_step_then_the_rule():
    for kv in (HEADS, 2):
        runs = []
        for clip in (True, False):
            model = _model(kv)
            opt = Muon([{"params": list(model.parameters()), "use_muon": True, "lr": 0.02}],
                       qk_clip_threshold=TAU if clip else None)  # fmt: skip
            if clip:
                opt.register_qk(model.q.weight, model.k.weight, HEADS, kv)
            x, y = _batch(0, 4)
            (model(x) - y).square().mean().backward()
            s_max = model.max_logits.clone()
            if clip:
                opt.observe_max_logits(model.q.weight, s_max)
            opt.step()
            clipped = None if clip else _rule(model, s_max)
            runs.append((model, clipped, s_max))
        (ours, _, s_max), (ref, clipped, _) = runs
        assert clipped == ([0, 1] if kv == HEADS else [0]), clipped  # some heads clipped, not all
        for name, p in ref.named_parameters():
            torch.testing.assert_close(dict(ours.named_parameters())[name], p, rtol=1e-6, atol=0, msg=f"{kv} {name}")
        # on the same input, a clipped head's largest logit is now tau (before the step's update moved it)
        model = _model(kv)
        before = model.logits(x).detach().amax(dim=(0, 2, 3))
        assert torch.equal(before, s_max)
        _rule(model, s_max)
        after = model.logits(x).detach().amax(dim=(0, 2, 3))
        for h in range(HEADS):
            want = TAU if s_max[h] > TAU else s_max[h]
            torch.testing.assert_close(after[h], torch.as_tensor(want), rtol=1e-5, atol=0)


def _cfg(stage):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "Muon", "params": {"lr": 0.02, "qk_clip_threshold": TAU_ENGINE,
                                                     "ns_method": "standard"}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip


def _engine_body(stage, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, optimizer, *_ = zero.initialize(model=_model(), config=_cfg(stage))
    model = engine.module
    optimizer.register_qk(model.q.weight, model.k.weight, HEADS)
    clipped = []
    for step in range(steps):
        x, y = _batch(step, 2 * world)
        x, y = x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]
        loss = (engine(x) - y).square().mean()
        optimizer.observe_max_logits(model.q.weight, model.max_logits)
        engine.backward(loss)
        engine.step()
        clipped.append(engine._qk_clip.clipped)
    full = engine.runtime.full_parameters()
    engine.destroy()
    return full, clipped


def _reference(steps):
    model = _model()
    opt = Muon([{"params": list(model.parameters()), "use_muon": True, "lr": 0.02, "ns_method": "standard"}],
               qk_clip_threshold=TAU_ENGINE)  # fmt: skip
    opt.register_qk(model.q.weight, model.k.weight, HEADS)
    for step in range(steps):
        x, y = _batch(step, 4)
        for part in (slice(0, 2), slice(2, 4)):  # the two ranks' micro-batches: the loss is their mean
            loss = (model(x[part]) - y[part]).square().mean() / 2
            loss.backward()
            opt.observe_max_logits(model.q.weight, model.max_logits)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_engine_clip_at_stages_2_and_3_equals_single_process():
    ref = _reference(3)
    for stage in (2, 3):
        for full, clipped in run_ranks(_engine_body, 2, stage, 3, timeout=120):
            assert sum(clipped) > 0, (stage, clipped)
            for n, v in ref.items():
                torch.testing.assert_close(full[n], v, rtol=1e-5, atol=1e-6, msg=f"stage {stage} {n}")


def test_bad_input_is_named():
    with pytest.raises(ConfigError, match="qk_clip_threshold"):
        load_config({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {"qk_clip_threshold": 0}}}, 1)
    model = _model()
    plain = Muon([{"params": list(model.parameters()), "use_muon": True}])
    with pytest.raises(ValueError, match="build Muon with qk_clip_threshold"):
        plain.register_qk(model.q.weight, model.k.weight, HEADS)
    opt = Muon([{"params": list(model.parameters()), "use_muon": True}], qk_clip_threshold=TAU)
    with pytest.raises(ValueError, match=r"do not split into 3 query"):
        opt.register_qk(model.q.weight, model.k.weight, 3)
    with pytest.raises(ValueError, match="not registered"):
        opt.observe_max_logits(model.v.weight, torch.zeros(HEADS))
    opt.register_qk(model.q.weight, model.k.weight, HEADS)
    with pytest.raises(ValueError, match="4 max logits expected"):
        opt.observe_max_logits(model.q.weight, torch.zeros(3))
    with pytest.raises(ValueError, match="qk_clip_threshold must be > 0"):
        Muon([{"params": list(model.parameters()), "use_muon": True}], qk_clip_threshold=-1.0)
