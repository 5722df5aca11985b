"""Several engines in one process: a ZeRO-2 student distilled from a ZeRO-3 teacher that has no optimizer, and a
ZeRO-3 policy beside a ZeRO-3 frozen reference (DPO's shape). Each keeps its own config, hooks, zero.Init records
and groups; destroying one leaves the other working. 2 gloo ranks against a single-process torch run."""

import pytest
import torch

import zero
from zero.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
)
from zero_comm.testing import run_ranks
from zero_core import registry

STEPS = 3


def _mlp(seed: int, width: int = 12) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.rand(3, 6, generator=torch.Generator().manual_seed(1000 * step + rank))


def _cfg(stage: int, optimizer: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}
    return cfg


def distill_body() -> dict:
    rank = torch.distributed.get_rank()
    student = _mlp(1)
    s_engine, *_ = zero.initialize(model=student, optimizer=torch.optim.AdamW(student.parameters(), lr=1e-3,
                                   weight_decay=0.0), config=_cfg(2))  # fmt: skip
    with zero.zero.Init(config_dict_or_path=_cfg(3)):
        teacher = _mlp(2, width=20)
    t_engine, t_opt, _, _ = zero.initialize(model=teacher, config=_cfg(3))
    t_engine.eval()
    with zero.zero.GatheredParameters(list(teacher.parameters())):
        t_before = [p.detach().clone() for p in teacher.parameters()]
    for step in range(STEPS):
        x = _batch(rank, step)
        with torch.no_grad():
            target = t_engine(x)
        loss = torch.nn.functional.mse_loss(s_engine(x), target)
        s_engine.backward(loss)
        s_engine.step()
    out = {"student": [p.detach().clone() for p in student.parameters()],
           "student_numels": [p.numel() for p in student.parameters()],
           "teacher_numels": [p.numel() for p in teacher.parameters()],
           "stages": (s_engine.zero_optimization_stage(), t_engine.zero_optimization_stage()), "t_opt": t_opt,
           "teacher_bytes": t_engine.runtime.model_state_bytes()}  # fmt: skip
    with zero.zero.GatheredParameters(list(teacher.parameters())):
        out["teacher_same"] = all(torch.equal(a, p) for a, p in zip(t_before, teacher.parameters()))
    return out


def _reference_student() -> list[torch.Tensor]:
    student, teacher = _mlp(1), _mlp(2, width=20)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, weight_decay=0.0)
    for step in range(STEPS):
        losses = []
        for rank in range(2):
            x = _batch(rank, step)
            with torch.no_grad():
                target = teacher(x)
            losses.append(torch.nn.functional.mse_loss(student(x), target))
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    return [p.detach() for p in student.parameters()]


def test_zero2_student_distilled_from_a_zero3_teacher_without_optimizer_equals_one_process():
    ref = _reference_student()
    for out in run_ranks(distill_body, 2, timeout=120):
        for got, want in zip(out["student"], ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert out["teacher_same"]  # bitwise: the teacher is never written
        assert out["student_numels"] == [p.numel() for p in ref]  # full-size at stage 2
        assert out["teacher_numels"] == [0] * 4  # partitioned (released outside forward)
        assert out["stages"] == (2, 3) and out["t_opt"] is None
        assert out["teacher_bytes"]["grads"] == out["teacher_bytes"]["master"] == 0


def dpo_shape_body(destroy: str) -> dict:
    rank = torch.distributed.get_rank()
    with zero.zero.Init(config_dict_or_path=_cfg(3)):
        policy = _mlp(1)
    p_engine, *_ = zero.initialize(model=policy, config=_cfg(3, optimizer=True))
    with zero.zero.Init(config_dict_or_path=_cfg(3)):
        ref = _mlp(1)
    r_engine, *_ = zero.initialize(model=ref, config=_cfg(3))
    r_engine.eval()
    for step in range(STEPS):
        if step == 1:  # one engine destroyed mid-run: the other goes on
            (p_engine if destroy == "policy" else r_engine).destroy()
        x = _batch(rank, step)
        with torch.no_grad():
            anchor = r_engine(x)  # after destroy(): a plain module holding the same weights
        if destroy == "policy" and step >= 1:
            continue
        loss = (p_engine(x) - anchor).square().mean() + p_engine(x).mean()
        p_engine.backward(loss)
        p_engine.step()
    with zero.zero.GatheredParameters(list(policy.parameters())):
        weights = [p.detach().clone() for p in policy.parameters()]
    with zero.zero.GatheredParameters(list(ref.parameters())):
        ref_weights = [p.detach().clone() for p in ref.parameters()]
    return {"policy": weights, "ref": ref_weights}


def _reference_policy(steps: int) -> list[torch.Tensor]:
    policy, ref = _mlp(1), _mlp(1)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)  # the config's AdamW: weight_decay 0.0
    opt.param_groups[0]["weight_decay"] = 0.0
    for step in range(steps):
        losses = []
        for rank in range(2):
            x = _batch(rank, step)
            with torch.no_grad():
                anchor = ref(x)
            losses.append((policy(x) - anchor).square().mean() + policy(x).mean())
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    return [p.detach() for p in policy.parameters()]


@pytest.mark.parametrize("destroy", ["reference", "policy"])
def test_zero3_policy_beside_a_zero3_frozen_reference_and_destroying_one(destroy):
    want = _reference_policy(STEPS if destroy == "reference" else 1)
    frozen = [p.detach() for p in _mlp(1).parameters()]
    for out in run_ranks(dpo_shape_body, 2, destroy, timeout=120):
        for got, ref in zip(out["policy"], want):
            torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(out["ref"], frozen))


def destroyed_lookup_body() -> dict:
    rank = torch.distributed.get_rank()
    gone_model, kept_model = _mlp(1), _mlp(2)
    gone, *_ = zero.initialize(model=gone_model, config=_cfg(2, optimizer=True))
    kept, *_ = zero.initialize(model=kept_model, config=_cfg(3, optimizer=True))
    for engine in (gone, kept):
        engine.backward(engine(_batch(rank, 0)).square().mean())
        engine.step()
    w = gone_model[0].weight
    out = {"gone_before": safe_get_full_fp32_param(w)}
    gone.destroy()
    out["gone_grad"] = safe_get_full_grad(w)  # a parameter no engine holds: its own .grad (cleared by destroy)
    out["errors"] = []
    for get in (safe_get_full_fp32_param, safe_get_local_fp32_param):
        try:
            get(w)
        except ValueError as e:
            out["errors"].append(str(e))
    out["gone_value"] = w.detach().clone()
    out["kept"] = [safe_get_full_fp32_param(p) for p in kept_model.parameters()]
    out["kept_exp_avg"] = safe_get_full_optimizer_state(kept_model[0].weight, "exp_avg")
    out["claimed"] = ([registry.lookup(p) is not None for p in gone_model.parameters()],
                      [registry.lookup(p) is not None for p in kept_model.parameters()])  # fmt: skip
    kept.destroy()
    return out


def _reference_one_step(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One AdamW step of ``_mlp(seed)`` on the mean of both ranks' losses: (parameters, first weight's exp_avg)."""
    model = _mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    (sum(model(_batch(rank, 0)).square().mean() for rank in range(2)) / 2).backward()
    opt.step()
    return [p.detach() for p in model.parameters()], opt.state[model[0].weight]["exp_avg"]


def test_destroyed_engine_parameters_are_no_engines_and_the_other_engine_still_answers():
    gone, _ = _reference_one_step(1)
    kept, kept_exp_avg = _reference_one_step(2)
    for out in run_ranks(destroyed_lookup_body, 2, timeout=120):
        torch.testing.assert_close(out["gone_before"], gone[0], rtol=0, atol=1e-6)
        assert out["gone_grad"] is None
        assert len(out["errors"]) == 2 and all("belongs to no live zero engine" in e for e in out["errors"])
        torch.testing.assert_close(out["gone_value"], gone[0], rtol=0, atol=1e-6)  # a plain tensor, trained
        for got, want in zip(out["kept"], kept, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(out["kept_exp_avg"], kept_exp_avg, rtol=0, atol=1e-7)
        assert out["claimed"] == ([False] * 4, [True] * 4)
