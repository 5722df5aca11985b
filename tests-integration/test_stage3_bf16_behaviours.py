"""Behaviours DeepSpeed's own engine pins, on 2 ranks: bf16 and stage-3 details users' models rely on.

* Stage 3 with bf16 on a model of many small parameters (50 blocks of ``Linear(2, 2)`` and ``LayerNorm(2)``, some
  units persistent, some not) runs forward and backward, and its first loss is the one the model cast to bf16
  computes on one process.
* ``"bf16": {"enabled": true}`` with a model returning several losses (a tuple holding a tensor, a dict and a list):
  each is computed in bf16 as DeepSpeed's cast model computes it (checked on DeepSpeed 0.19.8 on CPU: a
  cross-entropy of uniform logits over 10 classes gives 2.296875, ln 10 rounded to bf16, for every one).
* Stage 3: a parameter that a submodule returns from its forward (an "external" parameter its caller multiplies
  by) is AVAILABLE in the caller's forward, and the step equals one process's; every stage-3 parameter has
  ``ds_persist`` (True exactly for the persistent ones).
* bf16 at stage 3: a registered buffer (rotary ``inv_freq``) stays fp32 while the parameters are bf16, unless
  ``data_types.buffer_dtype`` asks for bf16.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks

BF16 = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "bf16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip


class _ManySmall(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2)) for _ in range(50)]
        )

    def forward(self, x):
        return self.blocks(x).float().pow(2).mean()


class _SeveralLosses(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 10)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, x, y):
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return loss, {"again": torch.nn.functional.cross_entropy(logits, y)}, [loss * 1]


class _Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 4))
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x @ self.weight + self.bias, self.weight


class _ReadsReturned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = _Table()
        self.seen: list = []

    def forward(self, x):
        h, w = self.table(x)
        self.seen.append(w.ds_status.name if hasattr(w, "ds_status") else "not partitioned")
        return (h @ w.t()).pow(2).mean()


class _Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, dtype=torch.float32) / 4)))

    def forward(self, x):
        return (self.proj(x) * self.inv_freq.to(x.dtype)).float().pow(2).mean()


def _init(model, config):
    import zero

    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _body() -> dict:
    out = {}
    x = torch.randn(2, 2, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = _ManySmall()
    cast = copy.deepcopy(model).bfloat16()
    engine = _init(model, {**BF16, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 2}})
    losses = []
    for _ in range(2):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    out["many"] = (losses, cast(x.bfloat16()).float())
    engine.destroy()

    model = _SeveralLosses()
    engine = _init(model, {**BF16, "zero_optimization": {"stage": 2}})
    loss, named, listed = engine(torch.randn(2, 4), torch.tensor([1, 2]))
    out["several"] = [(float(t), t.dtype) for t in (loss, named["again"], listed[0])]
    engine.destroy()

    torch.manual_seed(0)
    model = _ReadsReturned()
    reference = copy.deepcopy(model)
    xs = torch.randn(2 * dist.get_world_size(), 4, generator=torch.Generator().manual_seed(2))
    engine = _init(model, {**BF16, "bf16": {"enabled": False},
                           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 4}})  # fmt: skip
    rank = dist.get_rank()
    engine.backward(engine(xs[2 * rank : 2 * rank + 2]))
    engine.step()
    out["returned"] = {"seen": model.seen, "params": engine.runtime.full_parameters(),
                       "persist": {n: p.ds_persist for n, p in model.named_parameters()}}  # fmt: skip
    engine.destroy()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for r in range(dist.get_world_size()):
        (reference(xs[2 * r : 2 * r + 2]) / dist.get_world_size()).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt.step()
    out["returned"]["reference"] = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    for extra in ({}, {"data_types": {"buffer_dtype": "bf16"}}):
        model = _Rotary()
        engine = _init(model, {**BF16, **extra, "zero_optimization": {"stage": 3}})
        out[f"buffer {bool(extra)}"] = (model.inv_freq.dtype, {p.dtype for p in model.parameters()})
        engine.destroy()
    return out


def test_bf16_and_stage3_behaviours_deepspeed_pins():
    for rank, out in enumerate(run_ranks(_body, 2, timeout=300)):
        losses, cast_loss = out["many"]
        assert all(bool(torch.isfinite(v)) for v in losses), (rank, losses)
        assert torch.equal(losses[0], cast_loss), (rank, losses[0], cast_loss)
        assert not torch.equal(losses[0], losses[1]), f"rank {rank}: the step changed nothing"
        assert out["several"] == [(2.296875, torch.bfloat16)] * 3, (rank, out["several"])
        returned = out["returned"]
        assert returned["seen"] == ["AVAILABLE"], (rank, returned["seen"])
        assert returned["persist"] == {"table.weight": False, "table.bias": True}, (rank, returned["persist"])
        for k, want in returned["reference"].items():
            torch.testing.assert_close(returned["params"][k], want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {k}")
        assert out["buffer False"] == (torch.float32, {torch.bfloat16}), (rank, out["buffer False"])
        assert out["buffer True"] == (torch.bfloat16, {torch.bfloat16}), (rank, out["buffer True"])
