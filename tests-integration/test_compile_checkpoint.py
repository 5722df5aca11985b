"""Checkpoints on the compiled path (``compile.deepcompile`` true, zero_compile's passes through the core's seam):
save -> a fresh compiled engine loads -> resume equals the uninterrupted compiled run bitwise (losses, parameters,
counters) at ZeRO-3 and ZeRO-1 on 2 ranks; a compiled run's checkpoint loads into an eager engine, and the eager
engine's checkpoint back into a compiled one, with the loaded parameters bitwise equal to the saved ones and the
training continuing as the compiled run does (fp32 within 1e-6 relative: eager and compiled sum gradient chunks in
another order)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks
from zero_compile.testing import TinyTransformer, batches

ACC, STEPS, SAVE_AT = 2, 4, 2


def _engine(stage: int, compiled: bool, seed: int):
    import zero

    torch._dynamo.reset()  # warm workers are reused across tests
    torch.manual_seed(seed)
    model = TinyTransformer()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ACC,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
           "compile": {"deepcompile": compiled, "backend": "aot_eager", "warmup_steps": 0}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _train(engine, data, first: int, steps: int) -> list[float]:
    rank, losses = dist.get_rank(), []
    for step in data[first : first + steps]:
        for micro in step:
            loss = engine(*micro[rank])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _params(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.runtime.full_parameters().items()}


def _close(a: dict, b: dict, what: str, exact: bool) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=f"{what}: {k}")


def _body(root: str, stage: int) -> str:
    data = batches(STEPS, ACC, dist.get_world_size(), seed=7)
    control = _engine(stage, True, 0)
    want_losses = _train(control, data, 0, STEPS)
    want, want_lr = _params(control), control.get_lr()
    control.destroy()

    # compiled -> compiled: bitwise
    run = _engine(stage, True, 0)
    head = _train(run, data, 0, SAVE_AT)
    saved = _params(run)
    run.save_checkpoint(root, tag="compiled")
    run.destroy()
    fresh = _engine(stage, True, 123)
    fresh.load_checkpoint(root, tag="compiled")
    assert fresh.global_steps == SAVE_AT
    _close(_params(fresh), saved, "compiled load", exact=True)
    tail = _train(fresh, data, SAVE_AT, STEPS - SAVE_AT)
    assert head + tail == want_losses
    _close(_params(fresh), want, "compiled resume", exact=True)
    assert fresh.get_lr() == want_lr and fresh.global_steps == STEPS
    fresh.destroy()

    # compiled checkpoint -> eager engine -> its checkpoint -> compiled engine
    eager = _engine(stage, False, 5)
    eager.load_checkpoint(root, tag="compiled")
    _close(_params(eager), saved, "eager loads compiled", exact=True)
    mid = _train(eager, data, SAVE_AT, 1)
    at_eager_save = _params(eager)
    eager.save_checkpoint(root, tag="eager")
    eager.destroy()
    back = _engine(stage, True, 9)
    back.load_checkpoint(root, tag="eager")
    _close(_params(back), at_eager_save, "compiled loads eager", exact=True)
    last = _train(back, data, SAVE_AT + 1, STEPS - SAVE_AT - 1)
    torch.testing.assert_close(torch.tensor(head + mid + last), torch.tensor(want_losses), rtol=1e-6, atol=1e-7)
    _close(_params(back), want, "eager round trip", exact=False)
    assert back.global_steps == STEPS
    back.destroy()
    return "ok"


@pytest.mark.parametrize("stage", [3, 1])
def test_compiled_checkpoint_resumes_bitwise_and_crosses_to_eager(stage):
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_body, 2, root, stage, timeout=600) == ["ok", "ok"]
