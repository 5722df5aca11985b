"""Collective calls and bytes per step at the ZeRO paper's theory (arXiv 1910.02054 section 7: 2Ψ per rank for
stages 0-2, 3Ψ for stage 3, counted as a ring sends them: ``logical_bytes * busbw_factor`` of zero_comm's
CommsLogger), on 2 and 3 gloo ranks, one fp32 step. Ψ is the padded element count times 4 bytes; the one small
all-reduce of ``step()`` (global norm and has-gradient flags) and stage 3's once-per-step unit-order check are
counted apart. Reduction pieces smaller than a
bucket (DDP-sized) add calls, never bytes; stage-3 units reduced together (up to ``reduce_bucket_size``) save
calls, never bytes."""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime
from zero_core.reducer import GradReducer


def _one_step(stage: int, piece_bytes: int | None, extra: dict) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])  # 1088 elements, 8 parameters
    cfg = ZeroConfig(stage=stage, stage3_param_persistence_threshold=0, **extra)
    reducer = partial(GradReducer.from_inputs, piece_bytes=piece_bytes) if piece_bytes else None
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, grad_reduction=reducer)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(2):  # the second step is the steady one (stage 3 prefetches along the recorded order)
        with CommsLogger() as log:
            rt.backward(rt.module(x).square().mean(), is_boundary=True)
            rt.step()
    psi = sum(g.padded_numel for g in rt.flat_groups) * 4
    # the model's fp32 traffic; apart: step()'s fp64 norm / flags all-reduce, stage 3's int64 unit-order check
    big = [r for r in log.records if r.dtype == "torch.float32"]
    return {
        "psi": psi,
        "ring": sum(r.logical_bytes * r.busbw_factor for r in big),
        "wire": sum(r.wire_bytes for r in big),
        "small": len(log.records) - len(big),
        "names": sorted(r.name for r in big),
        "window_gathers": sum(r.algorithm == "window" for r in big),
        "pieces": len(rt.reducer.pieces),
        "units": sum(len(g.buckets) for g in rt.flat_groups),
        "batches": [len(bt.members) for bt in rt.reducer.mode.batches],
    }


def _body(configs):
    return [_one_step(*c) for c in configs]


# stage 3: the 4 units (one Linear each: 272 elements, 273 padded at 3 ranks) are reduced by one reduce-scatter; with
# ``reduce_bucket_size`` 600, two units per reduce-scatter
# ``stage3_shared_shards`` False (the default): the all-gathers themselves; "auto" (the last config): ranks on one
# host read the peers' shards from shared windows, with no collective
GATHER = {"stage3_max_reuse_distance": 0, "stage3_shared_shards": False}
CONFIGS = [(s, p, {}) for s in (0, 1, 2) for p in (None, 600)] + [
    (3, None, GATHER),
    (3, None, dict(GATHER, reduce_bucket_size=600)),
    (3, None, {"stage3_max_reuse_distance": 0, "stage3_shared_shards": "auto"}),
]


@pytest.mark.parametrize("world", [2, 3])
def test_calls_and_bytes_per_step_at_the_theory(world):
    for results in run_ranks(_body, world, CONFIGS, timeout=120):
        for (stage, piece, extra), r in zip(CONFIGS, results):
            label = f"world {world} stage {stage} piece_bytes {piece} {extra}"
            factor = 3 if stage == 3 else 2
            assert r["ring"] == pytest.approx(factor * (world - 1) / world * r["psi"], rel=1e-9), label
            assert r["small"] == 1 + (stage == 3), label  # norm / has-gradient all-reduce (+ unit-order check)
            if piece:
                assert r["pieces"] > 2, label  # several pieces in the one bucket
            else:
                assert r["pieces"] == r["units"], label
            reductions = {0: ["all_reduce"], 1: ["reduce_scatter_tensor"], 2: ["reduce_scatter_tensor"]}.get(stage)
            if stage == 3:  # each unit gathered for forward and again for backward; units reduced together
                assert r["batches"] == ([2, 2] if "reduce_bucket_size" in extra else [4]), label
                assert r["units"] == 4, label
                if extra.get("stage3_shared_shards") is False:
                    # 4 units gathered in 3 collectives each way: the current one, the next, the other 2 together
                    want = ["all_gather_into_tensor"] * 6 + ["reduce_scatter_tensor"] * len(r["batches"])
                    assert r["window_gathers"] == 0, label
                else:  # shared windows: each unit copied from the peers' shards (the same bytes), no collective
                    want = ["all_gather_into_tensor"] * 8 + ["reduce_scatter_tensor"] * len(r["batches"])
                    assert r["window_gathers"] == 8, label
            else:
                if piece:
                    reductions = ["all_reduce" if stage == 0 else "reduce_scatter_uneven"]
                want = reductions * r["pieces"] + ["all_gather_into_tensor"] * (stage > 0)
            assert r["names"] == sorted(want), label
