"""Cases of cases-2.md at the engine level, 2 gloo ranks against a single-process torch reference (fp32, 1e-6):

* The schedule's starting lr is in the optimizer before the first step, for the config's schedules and for a
  client ``torch.optim.lr_scheduler`` (an object or a callable), stages 0-3; every step's lr and the final weights
  equal the reference that runs at those lrs.
* ``save_checkpoint(save_latest=False)`` leaves ``latest`` alone; the engine's other accepted arguments act.
* An lr of 0 is accepted and trains nothing.
* A config without ``gradient_clipping`` clips at 1.0 as DeepSpeed 0.19.8 (TiedNet, stages 1-3) and equals
  a torch reference that calls ``clip_grad_norm_(params, 1.0)``; ``gradient_clipping: 0`` equals the unclipped one.
"""

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import parity_models as pm  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-5)
MICRO = 4


class Net3(nn.Module):
    """cases-2.md's Net3: Linear(6,8) -> tanh -> Linear(8,8) -> tanh -> Linear(8,3)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _net3() -> Net3:
    torch.manual_seed(7)
    return Net3()


def _batch(step: int, world: int = 2):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * MICRO, 6, generator=g), torch.randint(0, 3, (world * MICRO,), generator=g)


def _engine(model, stage: int, torch_opt=None, client_scheduler=None, **cfg):
    """An engine over ``model``; ``torch_opt`` a client optimizer (else the config's), ``cfg`` extra config keys."""
    import zero

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **cfg}  # fmt: skip
    return zero.initialize(model=model, optimizer=torch_opt, config=config, lr_scheduler=client_scheduler)[0]


def _full(eng) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in eng.runtime.full_parameters().items()}


def _train_recording_lr(eng, steps: int):
    """DeepSpeed's loop; returns (lr read just before each step, params after step 1, final params)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    used, after_first = [], None
    for step in range(steps):
        x, y = _batch(step)
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        eng.backward(F.cross_entropy(eng(x[sl]), y[sl]))
        used.append(eng.get_lr()[0])
        eng.step()
        if step == 0:
            after_first = _full(eng)
    return used, after_first, _full(eng)


def _reference_at(lrs: list[float]) -> dict[str, torch.Tensor]:
    model = _net3()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    for step, lr in enumerate(lrs):
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


ADAMW_CFG = {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0}}}
HV01_SCHED = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                                  "total_num_steps": 10, "warmup_type": "linear"}}  # fmt: skip


def _quarter_per_step(step: int) -> float:
    return step / 4


def _lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _quarter_per_step)


def _schedule_start_body(kind: str):
    out = []
    for stage in (0, 1, 2, 3):
        model = _net3()
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        if kind == "config":
            eng = _engine(model, stage, scheduler=HV01_SCHED, **ADAMW_CFG)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
            if kind == "torch_object":
                sched = torch.optim.lr_scheduler.LambdaLR(opt, _quarter_per_step)
            else:  # a callable optimizer -> scheduler, built on the engine's optimizer
                sched = _lambda_lr
            eng = _engine(model, stage, torch_opt=opt, client_scheduler=sched)
        before = eng.get_lr()
        used, after_first, final = _train_recording_lr(eng, 4)
        out.append((stage, before, used, initial, after_first, final))
    return out


@pytest.mark.parametrize("kind", ["config", "torch_object", "torch_callable"])
def test_schedule_lr_is_in_the_optimizer_before_the_first_step(kind):
    want = [0.0, 0.0, 0.0025, 0.005] if kind == "config" else [0.0, 0.0025, 0.005, 0.0075]
    ref = _reference_at(want)
    for rank, results in enumerate(run_ranks(_schedule_start_body, 2, kind, timeout=240)):
        for stage, before, used, initial, after_first, final in results:
            label = f"{kind} stage {stage} rank {rank}"
            assert before == [0.0], f"{label}: get_lr() before training is {before}"
            assert used == pytest.approx(want, abs=1e-12), f"{label}: lrs used {used}"
            for name, value in initial.items():
                torch.testing.assert_close(after_first[name], value, atol=0, rtol=0, msg=f"{label}: {name} moved")
                torch.testing.assert_close(final[name], ref[name], **TOL, msg=f"{label}: {name}")


def _save_latest_body(root: str):
    import zero_core.checkpoint as zc

    eng = _engine(_net3(), 2, **ADAMW_CFG)
    _train_recording_lr(eng, 1)
    a_params = _full(eng)
    eng.save_checkpoint(root, tag="a")
    _train_recording_lr(eng, 1)
    eng.save_checkpoint(root, tag="best", save_latest=False)
    latest_after_best = (pathlib.Path(root) / "latest").read_text()
    # zero_core's asynchronous path too (ranks > 0 wait for the commit without waiting for `latest`)
    zc.save_checkpoint(eng.runtime, root, "async_best", save_latest=False, async_save=True).wait(timeout=120)
    latest_after_async = (pathlib.Path(root) / "latest").read_text()
    path, _ = eng.load_checkpoint(root)  # no tag: `latest`
    return latest_after_best, latest_after_async, pathlib.Path(path).parent.name, a_params, _full(eng), eng.global_steps


def test_save_latest_false_leaves_latest_naming_the_previous_tag(tmp_path):
    for latest_best, latest_async, loaded, a_params, params, steps in run_ranks(_save_latest_body, 2, str(tmp_path),
                                                                               timeout=120):  # fmt: skip
        assert latest_best == "a" and latest_async == "a" and loaded == "a"
        assert steps == 1
        for name, value in a_params.items():
            torch.testing.assert_close(params[name], value, atol=0, rtol=0)
    assert (tmp_path / "best").is_dir() and (tmp_path / "async_best").is_dir()


def test_initialize_dist_init_required_false_without_a_group_is_a_clear_error():
    import subprocess

    # a fresh process: other tests may have left a process group in this one
    code = ("import torch, zero\n"
            "try:\n"
            f"    zero.initialize(model=torch.nn.Linear(2, 2), config={{'train_batch_size': 1, **{ADAMW_CFG!r}}},\n"
            "                    dist_init_required=False)\n"
            "except ValueError as e:\n"
            "    print('ERR', e, torch.distributed.is_initialized())\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERR initialize(dist_init_required=False): no process group exists" in out.stdout, out.stderr[-2000:]
    assert out.stdout.strip().endswith("False")  # and none was created


def test_initialize_distributed_port_is_the_rendezvous_port_without_master_port(tmp_path):
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    code = ("import os, torch, zero\n"
            "m = torch.nn.Linear(2, 2)\n"
            f"zero.initialize(model=m, config={{'train_batch_size': 1, **{ADAMW_CFG!r}}}, distributed_port={port})\n"
            "print(os.environ['MASTER_PORT'])\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(port)


def _default_clipping_body():
    import torch.distributed as dist

    import zero

    rank = dist.get_rank()
    out = []
    for stage in (1, 2, 3):
        for clip_key in ({}, {"gradient_clipping": 0}):
            model = pm.build("tied")
            opt = pm.make_optimizer("adamw", model.parameters())
            cfg = {"train_micro_batch_size_per_gpu": pm.MICRO_PER_RANK, **clip_key,
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
            eng = zero.initialize(model=model, optimizer=opt, config=cfg)[0]
            losses = []
            for step in range(4):
                x, y = pm.batch(step, 2, 1, "tied")
                sl = slice(rank * pm.MICRO_PER_RANK, (rank + 1) * pm.MICRO_PER_RANK)
                loss = F.cross_entropy(eng(x[sl]), y[sl])
                eng.backward(loss)
                eng.step()
                losses.append(loss.item())
            out.append((stage, bool(clip_key), eng.config.gradient_clipping, eng.runtime.full_parameters()))
    return out


def test_gradient_clipping_defaults_to_1_as_deepspeed_and_0_turns_it_off():
    clipped = pm.reference_run(dict(world=2, model="tied", steps=4, clip=1.0))
    unclipped = pm.reference_run(dict(world=2, model="tied", steps=4))
    assert clipped["norms"][0] > 1.5  # the case's premise: clipping at 1.0 changes this model's update
    for results in run_ranks(_default_clipping_body, 2, timeout=240):
        for stage, explicit_zero, clip, params in results:
            ref = unclipped if explicit_zero else clipped
            assert clip == (0.0 if explicit_zero else 1.0)
            for name, want in ref["params"].items():
                torch.testing.assert_close(params[name], want, **TOL, msg=f"stage {stage} clip {clip} {name}")


def _lr_zero_body():
    out = []
    for stage, opt_cfg in ((2, {"type": "AdamW", "params": {"lr": 0.0}}),
                           (3, {"type": "SGD", "params": {"lr": 0.0, "momentum": 0.9}}),
                           (1, {"type": "Adam", "params": {"lr": 0.0, "eps": 0.0}})):  # fmt: skip
        model = _net3()
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        eng = _engine(model, stage, optimizer=opt_cfg)
        _train_recording_lr(eng, 2)
        out.append((stage, opt_cfg["type"], eng.get_lr(), initial, _full(eng)))
    return out


def test_lr_zero_is_accepted_and_moves_nothing():
    for results in run_ranks(_lr_zero_body, 2, timeout=120):
        for stage, kind, lrs, initial, final in results:
            assert lrs == [0.0], (stage, kind)
            for name, value in initial.items():
                torch.testing.assert_close(final[name], value, atol=0, rtol=0, msg=f"{kind} stage {stage} {name}")
