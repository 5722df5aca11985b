"""Loss-scaler state and LR schedule after resume equal the uninterrupted run.

A dynamic scaler (window 3, hysteresis 2) sees injected overflows at steps 2 and 3; the checkpoint at step 5 holds
the scale below its initial value with the good-step counter mid-window. After loading into a fresh runtime,
steps 6-10 make the same scale and skip decisions, the same learning rates and the same parameters, bitwise.
Here the scaler and scheduler travel as ``extra_state``; through the engine's own ``save_checkpoint`` /
``load_checkpoint`` (fp16): tests-integration/test_checkpoint_engine.py.
"""

import tempfile

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import DynamicLossScaler, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import load_checkpoint, save_checkpoint

OVERFLOW_AT = (2, 3)


def build(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
    scaler = DynamicLossScaler(init_scale=2.0**4, scale_window=3, hysteresis=2)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=2), loss_scaler=scaler)
    return rt, sched


def run_steps(rt, sched, first, last):
    """Steps first..last (1-based); the scheduler advances only on steps that were not skipped (engine rule)."""
    trace = []
    for step in range(first, last + 1):
        g = torch.Generator().manual_seed(step * 7 + dist.get_rank())
        loss = rt.module(torch.randn(5, 9, generator=g)).pow(2).mean()
        if step in OVERFLOW_AT and dist.get_rank() == dist.get_world_size() - 1:
            loss = loss * float("inf")
        rt.backward(loss)
        result = rt.step()
        if result.stepped:
            sched.step()
        trace.append((step, rt.loss_scaler.scale, result.overflow, sched.get_last_lr()[0]))
    return trace


def extra(rt, sched):
    return {"loss_scaler": rt.loss_scaler.state_dict(), "lr_scheduler": sched.state_dict(), "skipped": rt.skipped_steps}


def _body(root):
    control, csched = build(0)
    expected = run_steps(control, csched, 1, 10)
    assert [t[2] for t in expected[:5]] == [False, True, True, False, False]
    assert expected[4][1] < 2.0**4, "the checkpoint must hold a scale below the initial one"

    run, sched = build(0)
    head = run_steps(run, sched, 1, 5)
    saved_scaler = dict(run.loss_scaler.state_dict())
    save_checkpoint(run, root, "step5", extra_state=extra(run, sched))

    fresh, fsched = build(123)
    res = load_checkpoint(fresh, root)
    fresh.loss_scaler.load_state_dict(res.extra_state["loss_scaler"])
    fsched.load_state_dict(res.extra_state["lr_scheduler"])
    fresh.skipped_steps = res.extra_state["skipped"]
    assert fresh.loss_scaler.state_dict() == saved_scaler  # scale, hysteresis, iteration counters exactly
    tail = run_steps(fresh, fsched, 6, 10)
    assert head + tail == expected, (head + tail, expected)
    assert fresh.skipped_steps == control.skipped_steps == 2
    for a, b in zip(fresh.module.parameters(), control.module.parameters()):
        assert torch.equal(a, b)
    return True


def test_loss_scaler_and_lr_resume_exactly():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_body, 2, root, timeout=120) == [True, True]
