"""``stage3_gather_16bit_weights_on_model_save`` at stage 3, as DeepSpeed: false (its default) gathers nothing and
writes nothing (``save_16bit_model`` returns False, Accelerate's ``get_state_dict`` path then raises); true gathers
and writes the full state dict."""

import contextlib
import os

import torch
import torch.distributed as dist

import zero
from zero_comm.testing import run_ranks

# every torch.distributed collective a gather of the full model could use
_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                "all_reduce", "reduce_scatter_tensor", "barrier", "gather", "scatter")  # fmt: skip
# torch's newer names of the first and of reduce_scatter_tensor (zero_comm calls these where torch has them)
_COLLECTIVES += tuple(n for n in ("all_gather_single", "reduce_scatter_single") if hasattr(dist, n))


@contextlib.contextmanager
def _count_collectives(calls: list):
    """Count every call of the collectives above made through ``torch.distributed`` (directly or through
    zero_comm) while inside."""
    import torch.distributed.distributed_c10d as c10d

    saved = []
    for name in _COLLECTIVES:
        for mod in (dist, c10d):
            fn = getattr(mod, name)

            def counted(*a, _fn=fn, _name=name, **k):
                calls.append(_name)
                return _fn(*a, **k)

            saved.append((mod, name, fn))
            setattr(mod, name, counted)
    from zero_comm import algorithms  # zero_comm's gathers call torch's function it bound at import

    for attr, name in (("_ALL_GATHER", "all_gather_single"), ("_REDUCE_SCATTER", "reduce_scatter_single")):
        fn = getattr(algorithms, attr)

        def counted(*a, _fn=fn, _name=name, **k):
            calls.append(_name)
            return _fn(*a, **k)

        saved.append((algorithms, attr, fn))
        setattr(algorithms, attr, counted)
    try:
        yield calls
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def flag_body(out: str, flag) -> dict:
    rank = dist.get_rank()
    zero_cfg = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if flag is not None:
        zero_cfg["stage3_gather_16bit_weights_on_model_save"] = flag
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": zero_cfg}  # fmt: skip
    engine, *_ = zero.initialize(model=_model(), config=cfg)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(x).square().mean())
    engine.step()
    dist.barrier()
    calls: list = []
    with _count_collectives(calls):
        returned = engine.save_16bit_model(out, "pytorch_model.bin")
    full = {k: v.clone() for k, v in engine.runtime.full_parameters().items()}
    return {"returned": returned, "calls": calls, "full": full,
            "asks_gather": engine.zero_gather_16bit_weights_on_model_save()}  # fmt: skip


def test_stage3_without_gathering_writes_nothing_and_gathers_nothing(tmp_path):
    for flag, sub in ((False, "off"), (None, "default")):
        out = tmp_path / sub
        for r in run_ranks(flag_body, 2, str(out), flag, timeout=90):
            assert r["returned"] is False and r["asks_gather"] is False
            assert r["calls"] == []  # not one collective: no rank gathered anything
        assert not out.exists()  # no bogus partial model either


def test_stage3_with_gathering_writes_the_full_state_dict(tmp_path):
    res = run_ranks(flag_body, 2, str(tmp_path), True, timeout=90)
    assert all(r["returned"] is True and r["asks_gather"] is True for r in res)
    gathers = {"all_gather_into_tensor", "all_gather_single"}
    assert all(gathers & set(r["calls"]) for r in res)  # the counter sees the gather
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert sorted(os.listdir(tmp_path)) == ["pytorch_model.bin"]
    assert set(state) == set(_model().state_dict())
    for name, value in res[0]["full"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
