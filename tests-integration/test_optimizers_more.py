"""DeepSpeed's other optimizers through zero.initialize: Lamb, Lion, Adagrad at stages 0-3 on 2 ranks, each equal
to a single-process reference over 20 steps; the 1-bit family only at stage 0, named errors otherwise.

References: Lamb and Lion are ours (torch has neither), so their references are written here again, plainly, per
parameter tensor, from the papers' formulas with DeepSpeed's FusedLamb/FusedLion conventions; Adagrad's is
``torch.optim.Adagrad``. Tolerance (fp32): parameters rtol 1e-5 / atol 2e-6 after 20 steps: only the summation
order of the cross-rank gradient average and of the sharded norms differs. Lion's update is ``lr * sign(...)``, so
an element whose interpolated momentum is within rounding of 0 could flip; with these seeds none is (a flip would
show as an error of 2 lr = 2e-3, far above the tolerance, and fail the test).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
from zero.config import NotSupportedError
from zero_comm.testing import run_ranks

STEPS = 20
MICRO = 4


def _model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 11), torch.nn.Tanh(), torch.nn.Linear(11, 5))  # 137 elements


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(world * MICRO, 6, generator=g), torch.randn(world * MICRO, 5, generator=g)


def _ref_lamb(params, state, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, max_c=10.0, min_c=0.01):
    for i, p in enumerate(params):
        st = state.setdefault(i, {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        st["t"] += 1
        st["m"] = b1 * st["m"] + (1 - b1) * p.grad
        st["v"] = b2 * st["v"] + (1 - b2) * p.grad * p.grad
        u = st["m"] / (st["v"].sqrt() + eps) + wd * p.data
        w_norm, u_norm = p.data.norm(), u.norm()
        trust = (w_norm / u_norm).clamp(min_c, max_c) if w_norm > 0 and u_norm > 0 else 1.0
        step_size = lr * (1 - b2 ** st["t"]) ** 0.5 / (1 - b1 ** st["t"])
        p.data -= step_size * trust * u


def _ref_lion(params, state, lr=1e-3, b1=0.9, b2=0.99, wd=0.1):
    for i, p in enumerate(params):
        m = state.setdefault(i, torch.zeros_like(p))
        c = b1 * m + (1 - b1) * p.grad
        p.data = p.data * (1 - lr * wd) - lr * torch.sign(c)
        state[i] = b2 * m + (1 - b2) * p.grad


OPTIMIZERS = {
    "Lamb": ({"lr": 1e-2, "weight_decay": 0.01}, _ref_lamb),
    "Lion": ({"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}, _ref_lion),
    "Adagrad": ({"lr": 5e-2, "weight_decay": 0.01}, None),
}


def reference(name: str, world: int) -> dict[str, torch.Tensor]:
    """Single process, full global batch (mean loss), the reference optimizer."""
    model = _model()
    params = list(model.parameters())
    kw, ref = OPTIMIZERS[name]
    torch_opt = torch.optim.Adagrad(params, **kw) if ref is None else None
    state: dict = {}
    for step in range(STEPS):
        x, y = _batch(step, world)
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        if torch_opt is not None:
            torch_opt.step()
        else:
            with torch.no_grad():
                ref(params, state)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(cfg: dict, steps: int) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    engine = zero.initialize(model=model, config=cfg)[0]
    for step in range(steps):
        x, y = _batch(step, world)
        sl = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(F.mse_loss(engine(x[sl]), y[sl]))
        engine.step()
    return engine.runtime.full_parameters()


def _body():
    out = {}
    for name, (kw, _) in OPTIMIZERS.items():
        for stage in (0, 1, 2, 3):
            cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
                   "optimizer": {"type": name, "params": kw},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                         "reduce_bucket_size": 100}}  # fmt: skip
            out[(name, stage)] = _train(cfg, STEPS)
    return out


def test_lamb_lion_adagrad_match_reference_at_every_stage():
    world = 2
    results = run_ranks(_body, world, timeout=300)
    for name in OPTIMIZERS:
        ref = reference(name, world)
        for stage in (0, 1, 2, 3):
            for rank, res in enumerate(results):
                got = res[(name, stage)]
                for key, want in ref.items():
                    label = f"{name} stage {stage} rank {rank} {key}"
                    torch.testing.assert_close(got[key], want, rtol=1e-5, atol=2e-6, msg=lambda m, s=label: f"{s}: {m}")
        moved = max((ref[k] - v).abs().max() for k, v in _model().state_dict().items())
        assert moved > 1e-3, f"{name}: the reference barely moved ({moved}); the comparison would prove nothing"


def _stage1_onebit():
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 2}}}  # fmt: skip
    try:
        zero.initialize(model=_model(), config=cfg)
    except NotSupportedError as e:
        return str(e)
    return None


def test_onebit_adam_is_stage_0_only_with_a_named_error():
    msg = run_ranks(_stage1_onebit, 1, timeout=60)[0]
    assert msg is not None and "zero_optimization.stage" in msg and "stage 0 only" in msg


@pytest.mark.parametrize("name", ["MuonWithAuxAdam"])
def test_still_rejected_types_say_what_to_use(name):
    from zero.config import load_config
    from zero.optim import build_optimizer

    with pytest.raises(NotSupportedError, match="optimizer.type"):
        cfg = load_config({"train_batch_size": 1, "optimizer": {"type": name, "params": {}}}, 1)
        build_optimizer(cfg.optimizer, _model().parameters())
