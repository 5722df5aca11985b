"""Sequence-tiled compute under ZeRO-3 on 2 gloo ranks (data parallel), through DeepSpeed's module path
(``deepspeed.runtime.sequence_parallel.ulysses_sp``): a gated MLP run by ``TiledMLP`` and a head with its loss run
by ``TiledFusedLogitsLoss``, 3 tiles of 10 positions, 2 SGD steps. The full gradients equal a single-process run of
the untiled modules on both ranks' batches (fp32, 1e-5 relative), and each unit (one per linear layer) is gathered
once in the forward and once in the backward of a step, not once per tile."""

import torch
import torch.nn.functional as F

import zero
from zero.engine.param_access import safe_get_full_grad
from zero.sequence_tiling import TiledFusedLogitsLoss, TiledMLP
from zero_comm.testing import run_ranks

RANKS, BATCH, SEQ, HIDDEN, VOCAB, SHARDS, STEPS, LR = 2, 2, 10, 8, 16, 3, 2, 0.1


class TinyModel(torch.nn.Module):
    """A residual gated MLP then a head: hidden 8 -> 12 -> 8 -> 16 logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.gate_proj = torch.nn.Linear(HIDDEN, 12, bias=False)
        self.up_proj = torch.nn.Linear(HIDDEN, 12, bias=False)
        self.down_proj = torch.nn.Linear(12, HIDDEN, bias=False)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.tiled = False

    def mlp(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x, y):
        if not self.tiled:
            h = x + self.mlp(x)
            return _loss(self.head, h, y)
        mlp_params = [self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight]
        h = x + TiledMLP.apply(TinyModel.mlp, self, x, SHARDS, mlp_params)
        return TiledFusedLogitsLoss.apply(_loss, self.head, h, y, None, SHARDS, list(self.head.parameters()), "sum")


def _loss(head, h, y):
    logits = head(h)
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum") / (BATCH * SEQ)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _reference() -> list[dict]:
    """One process, untiled, both ranks' batches; the loss is the mean of the ranks' (ZeRO averages over ranks)."""
    model = TinyModel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(STEPS):
        opt.zero_grad()
        sum(model(*_batch(step, r)) for r in range(RANKS)).div(RANKS).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return grads


def _tiled_stage3() -> dict:
    from zero_core.shard_state import ShardState
    from zero_core.units import Units

    gathers: list = []
    plain_gather = Units.gather

    def counting_gather(self, b, **kw):
        if self.buffers[b.index].state is ShardState.SHARDED:
            gathers.append(tuple(s.name for s in b.slots))
        return plain_gather(self, b, **kw)

    Units.gather = counting_gather  # every gather of every stage-3 store (hooks, prefetch, blocks)
    model = TinyModel()
    model.tiled = True
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_reuse_distance": 0}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg)
    rank = torch.distributed.get_rank()
    grads, counts = [], []
    for step in range(STEPS):
        gathers.clear()
        loss = engine(*_batch(step, rank))
        forward = sorted(gathers)
        gathers.clear()
        engine.backward(loss)
        backward = sorted(gathers)
        grads.append({n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()})
        engine.step()
        counts.append((forward, backward))
    engine.destroy()
    return {"grads": grads, "counts": counts}


def test_tiled_compute_under_stage3_equals_the_untiled_single_process_run():
    want = _reference()
    units = sorted([("gate_proj.weight",), ("up_proj.weight",), ("down_proj.weight",), ("head.weight", "head.bias")])
    for out in run_ranks(_tiled_stage3, RANKS, timeout=120):
        for forward, backward in out["counts"]:
            assert forward == units and backward == units, (forward, backward)  # once per pass, not per tile
        for got, exp in zip(out["grads"], want):
            for name, g in got.items():
                rel = ((g - exp[name]).norm() / exp[name].norm()).item()
                assert rel <= 1e-5, (name, rel)
