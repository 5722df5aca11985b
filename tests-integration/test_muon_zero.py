"""Muon through zero.initialize at stages 0-3 on gloo ranks, each equal to a single-process reference of the rule.

The reference (``_ref_muon_step``) is written here from the update rule, per whole parameter, not from the code
under test: momentum ``M = beta M + (1 - beta) G``, Nesterov blend ``U = (1 - beta) G + beta M``, five quintic
Newton-Schulz iterations on the Frobenius-normalised ``U`` (wide orientation), the ``sqrt(max(1, rows / cols))``
scale, decoupled weight decay, ``W -= lr O``; the auxiliary AdamW for the rest. It runs in float64, so the only
differences left are the fp32 rounding of the run under test (cross-rank gradient sums, the iterations).

Tolerances: one step in fp32 within 1e-3 (absolute, on weights of order 0.1); the accumulation / resharding runs rtol
1e-5 (atol 1e-6) with ``ns_method: "standard"``; bf16 by direction (cosine > 0.99) and step size (within 5%) of the
weight change, against a reference that rounds the starting weights and gradients to bf16 as the run stores them and
computes forward and backward in the run's compute dtype (bf16 on CPUs with bf16 matrix units, whose gradients differ
from an fp32 backward's by more than bf16 rounding); Newton-Schulz weighs every singular direction alike, so the
gradient's bf16 rounding turns the update by a few degrees. A plain SGD step (``-lr G``) is a different direction and
size: the tests check that it is far from what ran. Every config sets ``gradient_clipping`` explicitly (zero clips at
1.0 when it is absent); clipping scales the gradient before Muon sees it, as ``torch.nn.utils.clip_grad_norm_`` before
``step()``.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
from zero.config import NotSupportedError
from zero_comm.testing import run_ranks

MICRO = 4


def _ns(u: torch.Tensor) -> torch.Tensor:
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if tall else x


def _ref_muon_step(params, state, lr, beta, wd=0.0, adam_lr=None, betas=(0.9, 0.95), eps=1e-10):
    """One step of the rule over (name, parameter) pairs with ``.grad`` (float64), 2-D -> Muon, else AdamW."""
    for name, p in params:
        g = p.grad.double()
        if p.dim() >= 2:
            m = state.setdefault(name, torch.zeros_like(g))
            m.mul_(beta).add_(g, alpha=1 - beta)
            u = (1 - beta) * g + beta * m
            o = _ns(u) * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))
            p.data = (p.data.double() * (1 - lr * wd) - lr * o).to(p.dtype)
            continue
        st = state.setdefault(name, {"t": 0, "m": torch.zeros_like(g), "v": torch.zeros_like(g)})
        st["t"] += 1
        st["m"] = betas[0] * st["m"] + (1 - betas[0]) * g
        st["v"] = betas[1] * st["v"] + (1 - betas[1]) * g * g
        mh, vh = st["m"] / (1 - betas[0] ** st["t"]), st["v"] / (1 - betas[1] ** st["t"])
        lr_a = lr if adam_lr is None else adam_lr
        p.data = (p.data.double() * (1 - lr_a * wd) - lr_a * mh / (vh.sqrt() + eps)).to(p.dtype)


def _two_layer(kind: str):
    torch.manual_seed(3)
    if kind == "handed":
        return torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 8, bias=False))  # fmt: skip
    if kind == "straddle":  # 170 elements: the first matrix crosses the 85-element shard boundary of 2 ranks
        return torch.nn.Sequential(torch.nn.Linear(10, 10, bias=False), torch.nn.Linear(10, 7, bias=False))
    return torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7))  # with biases


def _batch(step: int, world: int, n_in: int, n_out: int, micro: int = MICRO):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(world * micro, n_in, generator=g), torch.randn(world * micro, n_out, generator=g)


def _dims(kind: str) -> tuple[int, int]:
    return (16, 8) if kind == "handed" else (10, 7)


def reference(kind: str, world: int, steps: int, gas: int = 1, lr: float = 0.02, beta: float = 0.95, wd=0.0):
    """Single process, float64, the whole global batch of each micro-step (mean loss), averaged over ``gas``."""
    model = _two_layer(kind).double()
    n_in, n_out = _dims(kind)
    state: dict = {}
    for step in range(steps):
        model.zero_grad()
        for micro in range(gas):
            x, y = _batch(step * gas + micro, world, n_in, n_out)
            (F.mse_loss(model(x.double()), y.double()) / gas).backward()
        with torch.no_grad():
            _ref_muon_step(list(model.named_parameters()), state, lr, beta, wd)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def _cfg(stage, precision="fp32", gas=1, ns="gram", zero_block=True, **extra):
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "ns_method": ns}}}  # fmt: skip
    if zero_block:
        cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, kind: str, steps: int, gas: int, first: int = 0):
    rank, world = dist.get_rank(), dist.get_world_size()
    n_in, n_out = _dims(kind)
    sl = slice(rank * MICRO, (rank + 1) * MICRO)
    for step in range(first, first + steps):
        for micro in range(gas):
            x, y = _batch(step * gas + micro, world, n_in, n_out)
            engine.backward(F.mse_loss(engine(x[sl]).float(), y[sl]))
            engine.step()
    return engine.runtime.full_parameters()


# ---------------------------------------------------------------- the handed case: one step, every stage
def _one_step_everywhere():
    """(precision, stage) -> the full parameters after one step; "compute" -> the bf16 runs' compute dtype."""
    out = {}
    for precision in ("fp32", "bf16"):
        for stage in (None, 0, 1, 2, 3):
            cfg = _cfg(stage or 0, precision, zero_block=stage is not None)
            engine = zero.initialize(model=_two_layer("handed"), config=cfg)[0]
            out[(precision, stage)] = _train(engine, "handed", 1, 1)
            if precision == "bf16":
                out["compute"] = engine.runtime.precision.compute  # bf16 where the CPU has bf16 matrix units
            engine.destroy()
    return out


def reference_bf16_one_step(world: int, compute: torch.dtype) -> dict[str, torch.Tensor]:
    """The handed case's step as a bf16 run sees it: bf16-rounded starting weights, forward and backward in the run's
    compute dtype (fp32, or bf16 on a CPU with bf16 matrix units), each rank's gradient rounded to bf16 (its storage
    and communication dtype), their average rounded to bf16; then the rule in float64."""
    model = _two_layer("handed")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    x, y = _batch(0, world, 16, 8)
    run = model.to(compute)
    grads = []
    for r in range(world):
        run.zero_grad()
        sl = slice(r * MICRO, (r + 1) * MICRO)
        F.mse_loss(run(x[sl].to(compute)).float(), y[sl]).backward()
        grads.append([p.grad.bfloat16().float() for p in run.parameters()])
    model = model.float()
    for p, *gs in zip(model.parameters(), *grads):
        p.grad = (sum(gs) / world).bfloat16().float()
    with torch.no_grad():
        _ref_muon_step(list(model.named_parameters()), {}, 0.02, 0.95)
    return {n: p.detach() for n, p in model.named_parameters()}


def _sgd_step(world: int) -> dict[str, torch.Tensor]:
    model = _two_layer("handed")
    x, y = _batch(0, world, 16, 8)
    F.mse_loss(model(x), y).backward()
    return {n: (p - 0.02 * p.grad).detach() for n, p in model.named_parameters()}


def test_one_step_is_muon_at_every_stage_and_precision():
    world = 2
    results = run_ranks(_one_step_everywhere, world, timeout=300)
    ref = reference("handed", world, 1)
    ref_bf16 = reference_bf16_one_step(world, results[0].pop("compute"))
    results[1].pop("compute")
    init = {n: p.detach() for n, p in _two_layer("handed").named_parameters()}
    sgd = _sgd_step(world)
    for (precision, stage), got in results[0].items():
        for n, want in ref.items():
            label = f"{precision} stage {stage} {n}"
            assert torch.equal(got[n], results[1][(precision, stage)][n]), f"{label}: ranks differ"
            start = init[n] if precision == "fp32" else init[n].bfloat16().float()
            d_got, d_ref, d_sgd = got[n] - start, want - init[n], sgd[n] - init[n]
            if precision == "fp32":
                torch.testing.assert_close(got[n], want, rtol=0, atol=1e-3, msg=lambda m, s=label: f"{s}: {m}")
                err = ((d_got - d_ref).norm() / d_ref.norm()).item()
                assert err < 1e-4, f"{label}: the weight change is {err} away from the reference's (relative)"
            else:  # Newton-Schulz weighs every singular direction alike, the gradient's bf16 noise included
                d_bf16 = ref_bf16[n] - start
                cos = F.cosine_similarity(d_got.reshape(1, -1), d_bf16.reshape(1, -1)).item()
                ratio = (d_got.norm() / d_bf16.norm()).item()
                assert cos > 0.99 and abs(ratio - 1) < 0.05, f"{label}: cosine {cos}, size ratio {ratio}"
                cos_fp32 = F.cosine_similarity(d_got.reshape(1, -1), d_ref.reshape(1, -1)).item()
                assert cos_fp32 > 0.9, f"{label}: cosine {cos_fp32} to the fp32 step"
            assert (d_sgd - d_ref).norm() > 0.5 * d_ref.norm(), f"{n}: the reference is close to SGD's step"
            assert (d_got - d_sgd).norm() > 0.5 * d_ref.norm(), f"{label}: ran the plain SGD step"


# ---------------------------------------------------------------- a matrix straddling the shard boundary
def _straddle(stage: int, under_init: bool):
    if under_init:
        with zero.Init():
            model = _two_layer("straddle")
    else:
        model = _two_layer("straddle")
    engine, opt, _, _ = zero.initialize(model=model, config=_cfg(stage, ns="standard"))
    names = {id(p): n for n, p in engine.module.named_parameters()}
    muon = sorted(names[id(s.param)] for g in engine.runtime.flat_groups for s in g.slots
                  if g.group_index is not None and opt.param_groups[g.group_index]["use_muon"])  # fmt: skip
    got = _train(engine, "straddle", 3, 1)
    engine.destroy()
    return muon, got


@pytest.mark.parametrize("stage,under_init", [(1, False), (2, False), (3, False), (3, True)])
def test_matrix_across_the_shard_boundary(stage, under_init):
    world = 2
    results = run_ranks(_straddle, world, stage, under_init, timeout=180)
    ref = reference("straddle", world, 3)
    for muon, _ in results:
        assert muon == ["0.weight", "1.weight"], f"Muon parameters {muon}"
    for n, want in ref.items():
        assert torch.equal(results[0][1][n], results[1][1][n]), f"{n}: ranks differ"
        torch.testing.assert_close(results[0][1][n], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- accumulation, 2 and 3 ranks, aux AdamW
def _accumulate(stage: int):
    engine = zero.initialize(model=_two_layer("biased"), config=_cfg(stage, gas=2, ns="standard"))[0]
    return _train(engine, "biased", 3, 2)


@pytest.mark.parametrize("world", [2, 3])
def test_accumulation_two_matches_reference_on_2_and_3_ranks(world):
    ref = reference("biased", world, 3, gas=2)
    init = {n: p.detach() for n, p in _two_layer("biased").named_parameters()}
    for stage in (1, 2, 3):
        results = run_ranks(_accumulate, world, stage, timeout=180)
        for rank, got in enumerate(results):
            for n, want in ref.items():
                label = f"stage {stage} rank {rank} {n}"
                torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6, msg=lambda m, s=label: f"{s}: {m}")
    assert min((ref[n] - init[n]).abs().max() for n in ref) > 1e-3, "the reference barely moved"


# ---------------------------------------------------------------- clipping: the gradient, as torch's clip_grad_norm_
def _clipped(stage: int):
    cfg = _cfg(stage, gas=2, ns="standard")
    cfg["gradient_clipping"] = 0.05
    engine = zero.initialize(model=_two_layer("biased"), config=cfg)[0]
    return _train(engine, "biased", 3, 2)


def test_gradient_clipping_clips_the_gradient_before_muon():
    results = run_ranks(_clipped, 2, 2, timeout=120)
    model = _two_layer("biased").double()
    state: dict = {}
    clipped_any = False
    for step in range(3):
        model.zero_grad()
        for micro in range(2):
            x, y = _batch(step * 2 + micro, 2, 10, 7)
            (F.mse_loss(model(x.double()), y.double()) / 2).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        clipped_any |= bool(norm > 0.05)
        with torch.no_grad():
            _ref_muon_step(list(model.named_parameters()), state, 0.02, 0.95)
    assert clipped_any, "the global norm never exceeded the clip: the test would prove nothing"
    unclipped = reference("biased", 2, 3, gas=2)
    for n, p in model.named_parameters():
        torch.testing.assert_close(results[0][n], p.detach().float(), rtol=1e-5, atol=1e-6)
    assert any((unclipped[n] - results[0][n]).abs().max() > 1e-4 for n in unclipped), "clipping changed nothing"


# ---------------------------------------------------------------- other seams the core's master serves
def _other_seams(zero_extra: dict, top_extra: dict, stage: int):
    cfg = {**_cfg(stage, gas=2, ns="standard", **zero_extra), **top_extra}
    engine = zero.initialize(model=_two_layer("biased"), config=cfg)[0]
    return _train(engine, "biased", 3, 2)


@pytest.mark.parametrize("zero_extra,top_extra,stage", [({"offload_param": {"device": "cpu"}}, {}, 3),
                                                        ({}, {"compile": {"deepcompile": True}}, 1)])  # fmt: skip
def test_parameter_offload_and_deepcompile_match_reference(zero_extra, top_extra, stage):
    results = run_ranks(_other_seams, 2, zero_extra, top_extra, stage, timeout=300)
    ref = reference("biased", 2, 3, gas=2)
    for got in results:
        for n, want in ref.items():
            torch.testing.assert_close(got[n], want, rtol=1e-5, atol=1e-6)


def _fp16_overflow():
    cfg = _cfg(2, gas=1, ns="standard")
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 40}  # the first steps overflow and are skipped
    engine = zero.initialize(model=_two_layer("biased"), config=cfg)[0]
    got = _train(engine, "biased", 30, 1)
    momentum = [engine.runtime.master.state_shard(g) for g in engine.runtime.flat_groups if g.group_index is not None]
    return got, engine.runtime.skipped_steps, momentum


def test_fp16_overflow_skips_leave_the_momentum_finite():
    got, skipped, states = run_ranks(_fp16_overflow, 2, timeout=120)[0]
    assert skipped > 0, "no step overflowed: the test would prove nothing"
    assert all(torch.isfinite(v).all() for v in got.values())
    bufs = [st["momentum_buffer"] for st in states if "momentum_buffer" in st]
    assert bufs and all(torch.isfinite(b).all() and b.abs().max() > 0 for b in bufs)


# ---------------------------------------------------------------- checkpoints: bitwise resume, resharding
def _save_then_continue(path: str, stage: int):
    engine = zero.initialize(model=_two_layer("biased"), config=_cfg(stage, gas=2, ns="standard"))[0]
    _train(engine, "biased", 2, 2)
    engine.save_checkpoint(path, tag="t")
    return _train(engine, "biased", 2, 2, first=2)


def _resume(path: str, stage: int):
    engine = zero.initialize(model=_two_layer("biased"), config=_cfg(stage, gas=2, ns="standard"))[0]
    engine.load_checkpoint(path, tag="t")
    return _train(engine, "biased", 2, 2, first=2)


def test_resume_is_bitwise_and_reshards(tmp_path):
    straight = run_ranks(_save_then_continue, 2, str(tmp_path), 2, timeout=180)
    resumed = run_ranks(_resume, 2, str(tmp_path), 2, timeout=180)
    for a, b in zip(straight, resumed):
        for n in a:
            assert torch.equal(a[n], b[n]), f"{n}: resumed run differs"
    ref = reference("biased", 2, 4, gas=2)
    # 2 ranks at stage 2 -> 3 ranks at stage 3: the shards and momentum re-sliced; the global batch is 3 ranks'
    # from step 2 on, so the reference switches batch too
    resharded = run_ranks(_resume, 3, str(tmp_path), 3, timeout=180)
    model = _two_layer("biased").double()
    state: dict = {}
    for step in range(4):
        model.zero_grad()
        for micro in range(2):
            x, y = _batch(step * 2 + micro, 2 if step < 2 else 3, 10, 7)
            (F.mse_loss(model(x.double()), y.double()) / 2).backward()
        with torch.no_grad():
            _ref_muon_step(list(model.named_parameters()), state, 0.02, 0.95)
    for n, p in model.named_parameters():
        torch.testing.assert_close(resharded[0][n], p.detach().float(), rtol=1e-5, atol=1e-6)
    assert any((ref[n] - resharded[0][n]).abs().max() > 1e-4 for n in ref), "3-rank batches changed nothing"


# ---------------------------------------------------------------- CPU offload: the host step equals the device's
def _offload_vs_device(stage: int, precision: str, path: str):
    out = {}
    for off in (None, {"device": "cpu"}):
        extra = {"offload_optimizer": off} if off else {}
        engine = zero.initialize(model=_two_layer("biased"), config=_cfg(stage, precision, gas=2, **extra))[0]
        _train(engine, "biased", 2, 2)
        if off is None:
            engine.save_checkpoint(path, tag="dev")
        else:  # a device-path checkpoint loads into the offloaded engine: its momentum continues on the host
            engine.load_checkpoint(path, tag="dev")
        out[off is not None] = (_train(engine, "biased", 2, 2, first=2), engine.runtime.master.host_bytes()
                                if off else 0)  # fmt: skip
        engine.destroy()
    return out


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_cpu_offload_equals_the_device_path(stage, precision, tmp_path):
    results = run_ranks(_offload_vs_device, 2, stage, precision, str(tmp_path), timeout=180)
    for rank, res in enumerate(results):
        (device, _), (host, host_bytes) = res[False], res[True]
        assert host_bytes > 0, "nothing lived in host memory"
        for n in device:
            assert torch.equal(device[n], host[n]), f"stage {stage} {precision} rank {rank} {n}: offload differs"
    if precision == "fp32":
        ref = reference("biased", 2, 4, gas=2)
        for n, want in ref.items():
            torch.testing.assert_close(results[0][True][0][n], want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- refusals
def _refused(offload: dict | None):
    cfg = _cfg(2, offload_optimizer=offload) if offload else _cfg(2)
    if offload is None:
        cfg["compile"] = {"deepcompile": True, "offload_opt_states": True}
    try:
        zero.initialize(model=_two_layer("handed"), config=cfg)
    except NotSupportedError as e:
        return str(e)
    return None


@pytest.mark.parametrize("offload,key", [({"device": "nvme", "nvme_path": "/tmp"}, "offload_optimizer.device"),
                                         ({"device": "cpu", "super_offload": True}, "super_offload"),
                                         ({"device": "cpu", "ratio": 0.5}, "ratio"),
                                         (None, "compile.offload_opt_states")])  # fmt: skip
def test_what_muon_cannot_serve_is_refused_naming_it(offload, key):
    msg = run_ranks(_refused, 1, offload, timeout=60)[0]
    assert msg is not None and "Muon" in msg and key in msg and "stage 2" in msg, msg
