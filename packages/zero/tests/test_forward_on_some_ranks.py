"""A stage-3 forward run on some ranks only (the user error "generate() on rank 0 only at ZeRO-3") ends within the
process group's timeout with an error naming the all-gather, the ranks that did not join and the likely cause,
instead of waiting out torch's 30 minutes in silence."""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import zero
from zero_comm.testing import run_ranks

TIMEOUT = 5.0  # the process group's timeout, seconds (what init_distributed(timeout=...) sets)


def _engine(trained_steps: int):
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, config=cfg)
    for step in range(trained_steps):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step + dist.get_rank()))
        engine.backward(engine(x).square().mean())
        engine.step()
    return engine


def one_rank_forward_body(trained_steps: int) -> dict:
    """Rank 0 runs a forward (as generate() would); rank 1 does not, and waits for rank 0's verdict outside any
    collective (through the store), as a rank busy elsewhere would."""
    engine = _engine(trained_steps)
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if dist.get_rank() != 0:
        store.wait(["verdict"], timedelta(seconds=20 * TIMEOUT))
        return {}
    engine.eval()
    start = time.monotonic()
    try:
        with torch.no_grad():
            engine.module(torch.randn(1, 8))
        out = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test inspects whatever was raised
        out = {
            "error": f"{type(e).__module__}.{type(e).__qualname__}",
            "message": str(e),
            "timeout_error": isinstance(e, TimeoutError),
            "missing": getattr(e, "missing", None),
        }
    out["elapsed"] = time.monotonic() - start
    store.set("verdict", "1")
    return out


def _check(out: dict) -> None:
    assert out["error"] is not None, "the forward on rank 0 alone completed"
    message = out["message"]
    assert out["error"] == "zero_core.stage3_errors.MissingRanksError" and out["timeout_error"], out
    assert out["missing"] == [1], message
    assert "all-gather" in message and "'0.weight'" in message, message  # the collective and its parameters
    assert "rank 1" in message and "generate" in message, message  # who is missing and the likely cause
    assert out["elapsed"] < 5 * TIMEOUT, out["elapsed"]


def test_forward_on_rank_0_only_before_training_is_named_within_the_timeout():
    _check(run_ranks(one_rank_forward_body, 2, 0, timeout=30 * TIMEOUT, pg_timeout=TIMEOUT)[0])


def test_forward_on_rank_0_only_after_training_is_named_within_the_timeout():
    _check(run_ranks(one_rank_forward_body, 2, 2, timeout=30 * TIMEOUT, pg_timeout=TIMEOUT)[0])
