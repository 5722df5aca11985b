"""A gradient the user edits between ``backward`` and ``step`` (DeepSpeed's ``safe_set_full_grad`` /
``safe_set_local_grad``) drives the norm, the clip and the update on every path: no offload, CPU offload (torch
SGD on the host, CPU Adam), SuperOffload's speculative step, NVMe offload with gradients in host memory and with
gradients streamed to the swap files (stage 3 with ``offload_param``); each equal to a single-process reference."""

import math

import pytest
import torch

import zero
from zero.engine.param_access import safe_get_full_grad, safe_get_local_grad, safe_set_full_grad, safe_set_local_grad
from zero_comm.testing import run_ranks

LIMIT = 0.05
STEPS = 2


def _net():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(9, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))


def _x(step, rank):
    return torch.randn(2, 9, generator=torch.Generator().manual_seed(50 * step + rank))


def _loss(out):
    return 10 * out.square().sum()  # gradients mostly above LIMIT, clamped norm about 2: the clip acts


def _cfg(stage, optimizer, offload=None, offload_param=None, tmp=None):
    zo = {"stage": stage, "sub_group_size": 500, "stage3_param_persistence_threshold": 0}
    if offload is not None:
        zo["offload_optimizer"] = dict(offload, **({"nvme_path": tmp} if offload["device"] == "nvme" else {}))
    if offload_param is not None:
        zo["offload_param"] = offload_param
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": zo, "zero_force_ds_cpu_optimizer": False}  # fmt: skip
    if optimizer == "adamw":
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    return cfg


def _edit(engine, stage):
    for p in engine.module.parameters():
        safe_set_full_grad(p, safe_get_full_grad(p).clamp(-LIMIT, LIMIT))
        if stage == 3:
            safe_set_local_grad(p, safe_get_local_grad(p).clamp(-LIMIT, LIMIT))


def edited_body(stage, optimizer, offload, offload_param, tmp):
    model = _net()
    client = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd" else None
    cfg = _cfg(stage, optimizer, offload, offload_param, tmp)
    engine, *_ = zero.initialize(model=model, optimizer=client, config=cfg)
    rank, norms = torch.distributed.get_rank(), []
    for step in range(STEPS):
        engine.backward(_loss(engine(_x(step, rank))))
        _edit(engine, stage)
        engine.step()
        norms.append(engine.get_global_grad_norm())
    params = engine.runtime.full_parameters()
    spec = getattr(engine.runtime.master, "spec", None)
    undone = spec.stats["undone"] if spec is not None else None
    engine.destroy()
    return params, norms, undone


def _reference(optimizer):
    """One process: the two ranks' mean loss, gradients clamped, the global norm, torch's clip, the step."""
    model = _net()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        ((_loss(model(_x(step, 0))) + _loss(model(_x(step, 1)))) / 2).backward()
        for p in model.parameters():
            p.grad.clamp_(-LIMIT, LIMIT)
        norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
        norms.append(norm)
        coef = min(1.0, 1.0 / (norm + 1e-6))
        assert coef < 0.9  # the clip acts on the clamped gradients
        for p in model.parameters():
            p.grad.mul_(coef)
        opt.step()
    return dict(model.named_parameters()), norms


def _check(result, reference, rtol):
    (params, norms, _), (ref_params, ref_norms) = result, reference
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value.detach(), rtol=rtol, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [2, 3])
def test_edited_gradient_drives_norm_clip_and_sgd_update(stage, tmp_path):
    ref = _reference("sgd")
    plain = run_ranks(edited_body, 2, stage, "sgd", None, None, None, timeout=120, threads=1)
    host = run_ranks(edited_body, 2, stage, "sgd", {"device": "cpu"}, None, None, timeout=120, threads=1)
    for a, b in zip(plain, host):
        _check(a, ref, rtol=1e-5)
        assert b[1] == a[1]  # the same norms
        for name, value in a[0].items():
            assert torch.equal(b[0][name], value), name  # host offload steps exactly what the device steps


OFFLOADS = {
    "cpu-adam": ({"device": "cpu"}, None),
    "super-offload": ({"device": "cpu", "super_offload": True}, None),
    "nvme": ({"device": "nvme", "buffer_count": 2}, None),
    "nvme-streamed": ({"device": "nvme", "buffer_count": 2}, {"device": "cpu"}),
}


@pytest.mark.parametrize(("stage", "kind"), [(2, "cpu-adam"), (2, "super-offload"), (2, "nvme"), (3, "cpu-adam"),
                                             (3, "super-offload"), (3, "nvme"), (3, "nvme-streamed")])  # fmt: skip
def test_edited_gradient_reaches_every_offload_path(stage, kind, tmp_path):
    ref = _reference("adamw")
    offload, offload_param = OFFLOADS[kind]
    for result in run_ranks(edited_body, 2, stage, "adamw", offload, offload_param, str(tmp_path), timeout=180,
                            threads=1):  # fmt: skip
        _check(result, ref, rtol=1e-5)
        if kind == "super-offload":
            assert result[2] > 0  # speculative steps of the unedited gradient were undone and stepped again
