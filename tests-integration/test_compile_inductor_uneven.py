"""Compiled ZeRO-3 (``compile.deepcompile``) under the default inductor backend on units that no world size divides.

A user compiles a small MLP (``Linear(8, 13) -> ReLU -> Linear(13, 7)``: units of 117 and 98 elements) at stage 3
with every parameter sharded, AdamW and accumulation 2, first on 2 ranks and then on 3, on one machine. Inductor
keeps compiled graphs in an on-disk cache keyed by the graph's code; when the gathered size was read from the store
by the fake kernel rather than written in the graph, the 3-rank run was handed the 2-rank graph and both ranks failed
in the first forward (``assert_size_stride``: expected size 117==118 on ``all_gather_wait``). What must hold:
parameters after 4 optimizer steps equal a single-process PyTorch run (1e-5 relative), with and without clipping,
under inductor as under aot_eager, at 2 and 3 ranks run one after the other with one inductor cache.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks

STEPS, ACC, MICRO, LR, WD = 4, 2, 2, 1e-2, 0.01


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 13), torch.nn.ReLU(), torch.nn.Linear(13, 7))


def _data(world: int):
    """``[step][micro] -> (x, y)`` holding every rank's rows: rank r takes rows ``[r * MICRO, (r + 1) * MICRO)``."""
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(world * MICRO, 8, generator=g), torch.randn(world * MICRO, 7, generator=g))
             for _ in range(ACC)] for _ in range(STEPS)]  # fmt: skip


def _reference(world: int, clip: float) -> dict[str, torch.Tensor]:
    """Single process: each step averages the gradients of every rank's micro-batches, clips the global norm, steps."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in _data(world):
        opt.zero_grad()
        for x, y in step:
            for r in range(world):
                rows = slice(r * MICRO, (r + 1) * MICRO)
                (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / (ACC * world)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(backend: str, clip: float, cache_dir: str) -> dict[str, torch.Tensor]:
    import zero

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read at each cache look-up: one cache for every run here
    torch._dynamo.reset()  # warm workers are reused across tests
    world, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACC, "gradient_clipping": clip,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "compile": {"deepcompile": True, "backend": backend}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    rows = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in _data(world):
        for x, y in step:
            engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
            engine.step()
    compiled = [kind for _, _, kind in engine.runtime.reducer.path.compiled.compiles]
    params = {k: v.clone() for k, v in engine.runtime.full_parameters().items()}
    engine.destroy()
    return {"params": params, "compiled": compiled}


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_uneven_units_train_like_one_process_at_two_then_three_ranks(backend, tmp_path):
    for world in (2, 3):
        for clip in (0.0, 0.05):
            ref = _reference(world, clip)
            for rank, out in enumerate(run_ranks(_train, world, backend, clip, str(tmp_path), timeout=900)):
                assert "backward" in out["compiled"], f"world {world} rank {rank} never ran a compiled backward"
                assert out["params"].keys() == ref.keys()
                for k in ref:
                    torch.testing.assert_close(out["params"][k], ref[k], rtol=1e-5, atol=1e-6,
                                               msg=f"{backend} world {world} clip {clip} rank {rank}: {k}")  # fmt: skip
