"""Users' failing cases (../shared/cases/cases.md) that touch the core, each asserting its right answer.

fp32 tolerance atol 1e-6 / rtol 1e-5 (cases.md). Cases needing the engine or offload are tested at the runtime
level here; what is left for those packages is noted per test.
"""

import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import parity_models as pm  # noqa: E402

TOL = dict(atol=1e-6, rtol=1e-5)


def _runs(specs):
    return [pm.sharded_run(s) for s in specs]


def _assert_matches_reference(spec, per_rank, **tol):
    ref = pm.reference_run(spec)
    for name, want in ref["params"].items():
        for rank, r in enumerate(per_rank):
            torch.testing.assert_close(r["params"][name], want, **(tol or TOL), msg=f"{spec}: rank {rank} {name}")
    return ref


def test_param_group_splits_and_per_group_lr_and_weight_decay():
    """Param group splits: one / two (odd split) / per-layer groups give the same training at ws=3, stages 1-3 (5
    steps). Per-group lr and weight decay at ws=2, stages 0-3, an lr edit through param_groups before step 4; the lr=0
    group stays bit-identical."""
    specs6 = [
        dict(world=3, stage=s, groups=g, steps=5, return_grads=True)
        for s in (1, 2, 3)
        for g in ("one", "two", "layers")
    ]
    out6 = run_ranks(_runs, 3, specs6, timeout=90)
    for i, spec in enumerate(specs6):
        ref = _assert_matches_reference(spec, [r[i] for r in out6])
        for r in out6:  # gradients through the accessor equal the reference's, whatever the grouping
            for name, g in ref["grads"].items():
                torch.testing.assert_close(r[i]["grads"][name], g, **TOL, msg=f"{spec} grad {name}")
    specs7 = [dict(world=2, stage=s, groups="lr", steps=4, lr_change=(3, 1, 5e-3)) for s in (0, 1, 2, 3)]
    out7 = run_ranks(_runs, 2, specs7, timeout=90)
    initial = pm.build()
    for i, spec in enumerate(specs7):
        _assert_matches_reference(spec, [r[i] for r in out7])
        for r in out7:
            assert r[i]["lrs"] == [1e-2, 5e-3, 0.0]
            assert torch.equal(r[i]["params"]["l3.weight"], initial.l3.weight.detach())
            assert torch.equal(r[i]["params"]["l3.bias"], initial.l3.bias.detach())


def test_stages_agree_over_ten_steps_with_accumulation():
    """Gradient accumulation: gas 4, 10 steps, ws 2 and 3, stages 0-3, overlap_comm on and off: every step's loss and
    the final parameters equal the reference (hence each other) within 1e-6."""
    for world in (2, 3):
        specs = [
            dict(world=world, stage=s, gas=4, steps=10, zero={"overlap_comm": o}) for s in (0, 1, 2, 3) for o in (0, 1)
        ]
        out = run_ranks(_runs, world, specs, timeout=90)
        for i, spec in enumerate(specs):
            ref = _assert_matches_reference(spec, [r[i] for r in out])
            losses = [sum(r[i]["losses"][k] for r in out) / world for k in range(10)]
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=0, rtol=1e-6)


def test_unused_parameters_never_hang():
    """U1 (extra never used, AdamW wd 0) and U2 (used on even steps, SGD) at ws=2, stages 1-3; with gradient
    clipping: with a never-used layer at stage 2, gas 1 and 4 (reported norm = norm of the used params)."""
    specs = []
    for s in (1, 2, 3):
        specs.append(dict(world=2, stage=s, model_kw={"extra": True}, extra_when="never", steps=4))
        specs[-1].update(optimizer="adamw", opt_kw={"wd": 0.0})
        specs.append(dict(world=2, stage=s, model_kw={"extra": True}, extra_when="even", steps=4, optimizer="sgd"))
    for gas in (1, 4):  # clipping with an unused layer (offload is zero_offload's)
        specs.append(
            dict(world=2, stage=2, model_kw={"extra": True}, extra_when="never", gas=gas, clip=0.05, opt_kw={"wd": 0.0})
        )
    out = run_ranks(_runs, 2, specs, timeout=60)
    initial = pm.build(extra=True)
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in out]
        ref = pm.reference_run(spec)
        for name, want in ref["params"].items():
            for r in per_rank:
                if spec["extra_when"] == "never" and name.startswith("extra"):
                    assert torch.equal(r["params"][name], initial.get_parameter(name).detach()), (spec, name)
                torch.testing.assert_close(r["params"][name], want, **TOL, msg=f"{spec} {name}")
        for r in per_rank:  # the norm is over the used parameters only, as the reference's
            torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), atol=0, rtol=1e-5)


def _divergent_body(sync: bool):
    import torch.distributed as dist

    from zero_core import RankDivergenceError, ZeroConfig, ZeroRuntime

    torch.manual_seed(pm.SEED)
    model = torch.nn.ModuleDict({"net": pm.TinyNet(), "head": torch.nn.Linear(4, 4)})
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0))  # fmt: skip
    k = torch.tensor([1 + dist.get_rank()])
    if sync:
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
    try:
        for step in range(2):
            x, y = pm.batch(step, 2, 1)
            xs, ys = x[dist.get_rank() * 3 :][:3], y[dist.get_rank() * 3 :][:3]
            h = rt.module["net"](xs)
            for _ in range(int(k)):
                h = rt.module["head"](h)
            rt.backward(F.cross_entropy(h, ys))
            rt.step()
    except RankDivergenceError as exc:
        return ("error", str(exc))
    return ("ok", rt.full_parameters())


def test_divergent_control_flow_raises_on_every_rank_and_sync_control_matches():
    results = run_ranks(_divergent_body, 2, False, timeout=60)
    assert [r[0] for r in results] == ["error", "error"], results
    assert "ranks gathered different parameter units" in results[0][1]
    results = run_ranks(_divergent_body, 2, True, timeout=60)
    torch.manual_seed(pm.SEED)
    ref = torch.nn.ModuleDict({"net": pm.TinyNet(), "head": torch.nn.Linear(4, 4)})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = pm.batch(step, 2, 1)
        opt.zero_grad()
        F.cross_entropy(ref["head"](ref["head"](ref["net"](x))), y).backward()
        opt.step()
    for name, p in ref.named_parameters():
        for status, params in results:
            assert status == "ok"
            torch.testing.assert_close(params[name], p.detach(), **TOL)


def test_noncontiguous_channels_last_and_broadcast():
    """Transposed layer-2 weight and a channels_last conv; ranks != 0 start from other weights; stages 0-3."""
    specs = [dict(world=2, stage=s, model="conv", check_init=True) for s in (0, 1, 2, 3)]
    out = run_ranks(_runs, 2, specs, timeout=60)
    initial = dict(pm.build("conv").named_parameters())
    for i, spec in enumerate(specs):
        per_rank = [r[i] for r in out]
        for r in per_rank:
            for name, p in initial.items():
                assert r["init"][name].shape == p.shape and torch.equal(r["init"][name], p.detach()), name
        _assert_matches_reference(spec, per_rank)


def test_tied_parameters_all_stages():
    """TiedNet: one Parameter used by the embedding and the output layer; ws=3, stages 0-3, gas 2."""
    specs = [dict(world=3, stage=s, model="tied", gas=2, steps=3) for s in (0, 1, 2, 3)]
    out = run_ranks(_runs, 3, specs, timeout=60)
    for i, spec in enumerate(specs):
        _assert_matches_reference(spec, [r[i] for r in out])
        assert all(all(r[i]["released"]) for r in out), "stage 3 left units gathered after backward"


@pytest.mark.parametrize("optimizer", ["adam", "sgdm", "adagrad"])
def test_other_optimizers(optimizer):
    """Any torch.optim.Optimizer sees only its fp32 shard: Adam, SGD with momentum, Adagrad; ws=2, stages 1-3."""
    specs = [dict(world=2, stage=s, optimizer=optimizer, gas=2, steps=3) for s in (1, 2, 3)]
    out = run_ranks(_runs, 2, specs, timeout=60)
    for i, spec in enumerate(specs):
        _assert_matches_reference(spec, [r[i] for r in out])


def _several_backwards_body(stage, boundary):
    import torch.distributed as dist

    from zero_core import ZeroConfig, ZeroRuntime

    rank = dist.get_rank()
    model = pm.build()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage))
    x, y = pm.batch(0, 2, 4)
    for k in range(4):  # four backward calls, one step, gas=1 semantics (every call may be marked a boundary)
        lo = k * 6 + rank * 3
        rt.backward(F.cross_entropy(rt.module(x[lo : lo + 3]), y[lo : lo + 3]), is_boundary=boundary)
    rt.step()
    return rt.full_parameters()


def test_several_backward_before_one_step_keep_every_micro_batch():
    model = pm.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = pm.batch(0, 2, 4)
    for k in range(4):
        F.cross_entropy(model(x[k * 6 : k * 6 + 6]), y[k * 6 : k * 6 + 6]).backward()
    opt.step()
    for stage in (0, 1, 2, 3):
        for boundary in (True, None):
            for params in run_ranks(_several_backwards_body, 2, stage, boundary, timeout=60):
                for name, p in model.named_parameters():
                    torch.testing.assert_close(params[name], p.detach(), **TOL, msg=f"stage {stage} {name}")


def _bf16_stage1_body():
    import torch.distributed as dist

    from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime

    rank = dist.get_rank()
    model = pm.build()
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ZeroConfig(stage=1), PrecisionPolicy.bf16())
    x, y = pm.batch(0, 2, 4)
    for k in range(4):
        lo = k * 6 + rank * 3
        rt.backward(F.cross_entropy(rt.module(x[lo : lo + 3]), y[lo : lo + 3]) / 4, is_boundary=k == 3)
    grads = {n: rt.full_grad(p) for n, p in model.named_parameters()}
    rt.step()
    return grads, rt.full_parameters()


def test_bf16_stage1_accumulated_gradient_identical_on_all_ranks():
    """At the boundary (before step) the fp32 accumulated gradient is bitwise identical on both ranks and equals the
    fp32 mean gradient within bf16 tolerance (rtol 2e-2 of the largest element: bf16 forward weights and a bf16
    reduction, each ~2^-8 relative)."""
    (g0, p0), (g1, p1) = run_ranks(_bf16_stage1_body, 2, timeout=60)
    model = pm.build()
    x, y = pm.batch(0, 2, 4)
    for k in range(4):
        (F.cross_entropy(model(x[k * 6 : k * 6 + 6]), y[k * 6 : k * 6 + 6]) / 4).backward()
    for name, p in model.named_parameters():
        assert torch.equal(g0[name], g1[name]) and torch.equal(p0[name], p1[name]), name
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(g0[name], p.grad, atol=2e-2 * scale, rtol=2e-2, msg=name)


def test_group_smaller_than_world_and_owned_shards_cover_the_model():
    """A group smaller than the world, at ws=4: a 3-element group leaves rank 3 owning only padding; stages 1-3, 5
    steps. The owned shard ranges of all ranks, padding stripped, tile the flattened reference parameters exactly."""
    specs = [dict(world=4, stage=s, model="plus", groups="plus", steps=5, return_shards=True) for s in (1, 2, 3)]
    out = run_ranks(_runs, 4, specs, timeout=90)
    for i, spec in enumerate(specs):
        ref = _assert_matches_reference(spec, [r[i] for r in out])
        for fg in range(len(out[0][i]["shards"])):
            names = out[0][i]["shards"][fg][0]
            flat = torch.cat([ref["params"][n].reshape(-1) for n in names])
            got = torch.full_like(flat, float("nan"))
            for r in out:
                _, ranges, shard = r[i]["shards"][fg]
                for lo, hi, at in ranges:
                    got[lo:hi] = shard[at : at + hi - lo]
            torch.testing.assert_close(got, flat, **TOL, msg=f"stage {spec['stage']} group {fg}")


def _overflow_body(stage, precision, optimizer):
    import torch.distributed as dist

    from zero_core import DynamicLossScaler, PrecisionPolicy, StaticLossScaler, ZeroConfig, ZeroRuntime

    rank = dist.get_rank()
    model = pm.build()
    fp16 = precision == "fp16"
    policy = PrecisionPolicy.fp16() if fp16 else PrecisionPolicy.bf16()
    scaler = DynamicLossScaler.from_deepspeed(4, 2, 1) if fp16 else StaticLossScaler()
    rt = ZeroRuntime(model, pm.make_optimizer(optimizer, model.parameters()), ZeroConfig(stage=stage), policy,
                     loss_scaler=scaler)  # fmt: skip
    record = []
    for step in (0, 1, 2):
        x, y = pm.batch(step, 2, 1)
        xs = x[rank * 3 : rank * 3 + 3].to(policy.compute)  # fp16 compute: inputs in fp16 (tiny: CPU fp16 is slow)
        loss = F.cross_entropy(rt.module(xs).float(), y[rank * 3 : rank * 3 + 3])
        if step == 1 and rank == 1:
            loss = loss * (float("inf") if fp16 else float("nan"))
        before = (rt.full_parameters(), _opt_state(rt.optimizer), scaler.scale)
        rt.backward(loss)
        res = rt.step()
        record.append((res, before, (rt.full_parameters(), _opt_state(rt.optimizer), scaler.scale)))
    return record, rt.skipped_steps


def _opt_state(opt):
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()} for st in opt.state.values()]


def _same_state(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )  # fmt: skip


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_overflow_step_is_skipped_cleanly_on_all_ranks(precision):
    """A non-finite loss on rank 1 at step 2: every rank skips; params and optimizer state (momentum, exp_avg,
    step) bitwise unchanged; fp16 scale halves (hysteresis 1), bf16 counts the skip; step 3 trains normally."""
    for stage in (1, 2, 3):
        for optimizer in ("adamw", "sgdm"):
            for record, skipped in run_ranks(_overflow_body, 2, stage, precision, optimizer, timeout=60):
                assert skipped == 1
                (r0, _, after0), (r1, before1, after1), (r2, _, after2) = record
                assert r0.stepped and not r1.stepped and r1.overflow and r2.stepped
                params_b, state_b, scale_b = before1
                params_a, state_a, scale_a = after1
                assert all(torch.equal(params_b[n], params_a[n]) for n in params_b)
                assert _same_state(state_b, state_a) and state_b
                assert scale_a == (scale_b / 2 if precision == "fp16" else 1.0)
                assert any(not torch.equal(after2[0][n], params_a[n]) for n in params_a)


def _u3_body(stage):
    import torch.distributed as dist

    from zero_core import RankDivergenceError, ZeroConfig, ZeroRuntime

    rank = dist.get_rank()
    model = pm.build(extra=True)
    model.use_extra = rank == 0  # rank-divergent use
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))  # fmt: skip
    try:
        for step in range(3):
            x, y = pm.batch(step, 2, 1)
            rt.backward(F.cross_entropy(rt.module(x[rank * 3 : rank * 3 + 3]), y[rank * 3 : rank * 3 + 3]))
            rt.step()
    except RankDivergenceError:
        return "diverged"
    return rt.full_parameters()


def test_layer_used_on_one_rank_only():
    """U3: ``extra`` used on rank 0 only. Stages 1/2: completes, ranks agree (the missing gradient counts as zero).
    Stage 3: the ranks gather different units, and every rank raises RankDivergenceError, never hangs."""
    for stage in (1, 2):
        p0, p1 = run_ranks(_u3_body, 2, stage, timeout=60)
        assert all(torch.equal(p0[n], p1[n]) for n in p0)
    assert run_ranks(_u3_body, 2, 3, timeout=60) == ["diverged", "diverged"]
