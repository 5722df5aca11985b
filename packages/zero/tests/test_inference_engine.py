"""An engine built without an optimizer runs forward only (DeepSpeed's ZeRO-Inference: TRL's reference and teacher
models, transformers' ``evaluate()`` without training): outputs equal the dense model's, stage 3 keeps the
parameters partitioned and gathers them per unit (prefetching along the recorded order, offload honoured), and no
gradient, master or optimizer memory exists. 2 gloo ranks against a single-process torch reference."""

import pytest
import torch

import zero
from zero_comm.testing import run_ranks
from zero_core import ShardState


def _net():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4))  # fmt: skip


def _cfg(stage: int, **zero_extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero_extra}}  # fmt: skip


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.rand(3, 8, generator=torch.Generator().manual_seed(100 * rank + step))


def forward_only_body(stage: int, zero_extra: dict) -> dict:
    rank = torch.distributed.get_rank()
    engine, opt, loader, sched = zero.initialize(model=_net(), config=_cfg(stage, **zero_extra))
    engine.eval()
    outs = []
    for step in range(4):
        with torch.no_grad():
            outs.append(engine(_inputs(rank, step)))
    with torch.enable_grad():  # grad mode on is fine too: nothing is kept for a backward
        outs.append(engine(_inputs(rank, 4)).detach())
    numels = [p.numel() for p in engine.module.parameters()]
    errors = {}
    for what, call in (("backward", lambda: engine.backward(outs[-1].sum())), ("step", engine.step)):
        try:
            call()
        except RuntimeError as e:
            errors[what] = str(e)
    store = engine.runtime.params
    return {"outs": outs, "bytes": engine.runtime.model_state_bytes(), "numels": numels, "errors": errors,
            "opt": opt, "sched": sched, "stage": engine.zero_optimization_stage(),
            "recorded": len(store.prefetch.order or []) if stage == 3 else 0,
            "host": store.storage.host_bytes() if zero_extra else 0, "lr": engine.get_lr()}  # fmt: skip


@pytest.mark.parametrize(("stage", "zero_extra"), [(3, {}), (3, {"offload_param": {"device": "cpu"}}),
                                                    (3, {"offload_param": {"device": "nvme"}}), (1, {}),
                                                    (0, {})])  # fmt: skip
def test_forward_only_engine_equals_dense_and_holds_no_training_state(stage, zero_extra, tmp_path):
    if zero_extra.get("offload_param", {}).get("device") == "nvme":
        zero_extra = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    results = run_ranks(forward_only_body, 2, stage, zero_extra, timeout=120)
    dense = _net()
    total = sum(p.numel() for p in dense.parameters()) * 4
    for rank, out in enumerate(results):
        for step, got in enumerate(out["outs"]):
            with torch.no_grad():
                assert torch.equal(got, dense(_inputs(rank, step))), (rank, step)
        assert out["opt"] is None and out["sched"] is None and out["lr"] == []
        assert out["stage"] == stage
        assert out["bytes"]["grads"] == 0 and out["bytes"]["master"] == 0 and out["bytes"]["optimizer"] == 0
        assert set(out["errors"]) == {"backward", "step"}
        assert all("without an optimizer" in e for e in out["errors"].values())
        if stage == 3:
            assert out["numels"] == [0] * 6  # released outside forward
            # partitioned: this rank's half of each unit (padding included), in host buffers when offloaded
            held = out["host"] if zero_extra else out["bytes"]["params"]
            assert total // 2 <= held <= total // 2 + 4 * 6
            assert out["bytes"]["params"] == (0 if zero_extra else held)
            assert out["recorded"] == 3  # the first pass recorded the unit order: later passes prefetch along it
        else:
            assert out["numels"] == [p.numel() for p in dense.parameters()]
            assert out["bytes"]["params"] == total


def prefetch_body() -> dict:
    rank = torch.distributed.get_rank()
    engine, *_ = zero.initialize(model=_net(), config=_cfg(3, stage3_prefetch_bucket_size=10**6))
    store = engine.runtime.params
    seen = []

    def watch(module, args):  # the units gathered or in flight when each Linear starts
        seen.append(sum(u.state is not ShardState.SHARDED for u in store.units.buffers))

    for m in engine.module:
        m.register_forward_pre_hook(watch)
    with torch.no_grad():
        for step in range(3):
            engine(_inputs(rank, step))
    return {"seen": seen, "live_after": store.live_numel()}


def test_forward_only_stage3_prefetches_along_the_recorded_order_and_releases_after_each_pass():
    for out in run_ranks(prefetch_body, 2, timeout=120):
        first, later = out["seen"][:5], out["seen"][5:10]
        # first pass (Linear, GELU, Linear, GELU, Linear): only the running Linear's unit is gathered
        assert first == [1, 0, 1, 0, 1]
        # recorded: the first Linear's gather also issues the next two units' gathers
        assert later == [3, 2, 2, 1, 1]
        assert out["live_after"] == 0


def held_body() -> dict:
    rank = torch.distributed.get_rank()
    engine, *_ = zero.initialize(model=_net(), config=_cfg(3))
    with torch.no_grad():
        first = engine(_inputs(rank, 0))
        with zero.zero.GatheredParameters(list(engine.module.parameters())):
            extra = [engine(_inputs(rank, 1 + i)) for i in range(1 + 2 * rank)]  # rank 1 runs more forwards
        last = engine(_inputs(rank, 9))
    return {"first": first, "extra": extra, "last": last, "released": [p.numel() for p in engine.module.parameters()]}


def test_forward_only_stage3_forwards_inside_gathered_parameters_need_no_peer():
    """Generation on a gathered model: ranks may run different numbers of forwards (no collective there)."""
    dense = _net()
    for rank, out in enumerate(run_ranks(held_body, 2, timeout=120)):
        with torch.no_grad():
            assert torch.equal(out["first"], dense(_inputs(rank, 0)))
            assert len(out["extra"]) == 1 + 2 * rank
            assert all(torch.equal(y, dense(_inputs(rank, 1 + i))) for i, y in enumerate(out["extra"]))
            assert torch.equal(out["last"], dense(_inputs(rank, 9)))
        assert out["released"] == [0] * 6
