"""Audit of the cases (cases.md) at the engine level: the recipes run through ``zero.initialize`` and the Engine's
``forward``/``backward``/``step`` (DeepSpeed's loop), where zero's other case tests drive ``zero_core.ZeroRuntime``.

* Gradient accumulation with the engine's own ``1/gas`` loss scaling: gas 4, ws 2 and 3, stages 0-3, overlap_comm on and
  off; every step's loss and the final params equal the single-process reference within 1e-6.
* Several backward calls before one step: gas=1, four ``backward`` calls then one ``step``, with and without the
  explicit "not a boundary" API (``set_gradient_accumulation_boundary``), stages 0-3: the update equals the reference
  that sums four gradients.
* Per-group lr: ``get_lr()`` returns one lr per group in group order, also after a ``param_groups`` edit.
* An overflow step: bf16 and fp16 engines, NaN/inf on rank 1 at step 2: skipped on every rank, params unchanged, the
  engine's ``skipped_steps`` counts it, the scheduler does not advance, the fp16 scale halves.
* Buffers keep their dtype and values through ``zero.Init`` and a bf16 engine's initialisation.
* Non-contiguous parameters: ``initialize`` succeeds on non-contiguous / channels_last params and broadcasts rank 0's
  weights.
* Bucket sizes: bad ones fail at ``initialize`` naming the field (stages 1-3); buckets 10x the model train normally.
* The engine's reported batch triple satisfies global = micro x gas x world at ws 2 and 3; bad triples fail.

fp32 tolerance atol 1e-6 / rtol 1e-5 (cases.md).
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
SCHED = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.005, "warmup_max_lr": 0.01, "warmup_num_steps": 10}}


def _engine(model, opt, stage: int, gas: int = 1, **extra):
    import zero

    zero_cfg = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}
    # gradient_clipping 0: the references do not clip (DeepSpeed's default 1.0 is zero's too)
    cfg = {"train_micro_batch_size_per_gpu": pm.MICRO_PER_RANK, "gradient_accumulation_steps": gas,
           "gradient_clipping": 0, "zero_optimization": zero_cfg, **extra}  # fmt: skip
    return zero.initialize(model=model, optimizer=opt, config=cfg)[0]


def _train(engine, steps: int, gas: int, model_name: str = "tiny"):
    """DeepSpeed's loop: forward, backward, step on every micro-batch; returns the mean loss per optimizer step."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    losses = []
    for step in range(steps):
        x, y = pm.batch(step, world, gas, model_name)
        micro, total = x.shape[0] // gas, 0.0
        for k in range(gas):
            lo = k * micro + rank * pm.MICRO_PER_RANK
            loss = F.cross_entropy(engine(x[lo : lo + pm.MICRO_PER_RANK]), y[lo : lo + pm.MICRO_PER_RANK])
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
    return losses


def _accumulation_body(steps: int):
    out = []
    for stage in (0, 1, 2, 3):
        for overlap in (False, True):
            model = pm.build()
            eng = _engine(
                model, pm.make_optimizer("adamw", model.parameters()), stage, 4, zero={"overlap_comm": overlap}
            )
            losses = _train(eng, steps, 4)
            out.append((stage, overlap, losses, eng.runtime.full_parameters(), eng.global_steps))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_engine_gas4_losses_and_params_match_reference_every_stage(world):
    steps = 4
    ref = pm.reference_run(dict(world=world, gas=4, steps=steps))
    results = run_ranks(_accumulation_body, world, steps, timeout=120)
    for i, (stage, overlap, _, _, global_steps) in enumerate(results[0]):
        label = f"ws {world} stage {stage} overlap {overlap}"
        assert global_steps == steps, label
        losses = [sum(r[i][2][k] for r in results) / world for k in range(steps)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), atol=1e-6, rtol=0, msg=label)
        for rank, r in enumerate(results):
            for name, want in ref["params"].items():
                torch.testing.assert_close(r[i][3][name], want, **TOL, msg=f"{label} rank {rank} {name}")


def _several_backwards_body(stage: int, explicit: bool):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = pm.build()
    eng = _engine(model, torch.optim.SGD(model.parameters(), lr=0.1), stage, 1)
    x, y = pm.batch(0, 2, 4)
    for k in range(4):
        if explicit:  # the library's "not a boundary" API for all but the last backward
            eng.set_gradient_accumulation_boundary(k == 3)
        lo = k * 6 + rank * 3
        eng.backward(F.cross_entropy(eng(x[lo : lo + 3]), y[lo : lo + 3]))
    eng.step()
    return eng.runtime.full_parameters(), eng.global_steps


def test_engine_several_backward_before_one_step_with_gas1():
    model = pm.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = pm.batch(0, 2, 4)
    for k in range(4):  # gas=1: the engine does not scale, so the update is lr x the sum of four gradients
        F.cross_entropy(model(x[k * 6 : k * 6 + 6]), y[k * 6 : k * 6 + 6]).backward()
    opt.step()
    for stage in (0, 1, 2, 3):
        for explicit in (False, True):
            for params, global_steps in run_ranks(_several_backwards_body, 2, stage, explicit, timeout=60):
                assert global_steps == 1
                for name, p in model.named_parameters():
                    torch.testing.assert_close(params[name], p.detach(), **TOL, msg=f"stage {stage} {name}")


def _lr_groups_body(stage: int, offload: bool = False):
    model = pm.build()
    extra = {"zero": {"offload_optimizer": {"device": "cpu"}}} if offload else {}
    eng = _engine(model, pm.make_optimizer("adamw", pm.param_groups(model, "lr")), stage, **extra)
    from zero_offload import OffloadMaster

    assert isinstance(eng.runtime.master, OffloadMaster) == offload, type(eng.runtime.master)
    lrs = [eng.get_lr()]
    _train(eng, 3, 1)
    eng.optimizer.param_groups[1]["lr"] = 5e-3  # as an LR scheduler would
    lrs.append(eng.get_lr())
    import torch.distributed as dist

    rank = dist.get_rank()
    x, y = pm.batch(3, 2, 1)
    eng.backward(F.cross_entropy(eng(x[rank * 3 : rank * 3 + 3]), y[rank * 3 : rank * 3 + 3]))
    eng.step()
    return lrs, eng.runtime.full_parameters()


def test_engine_get_lr_per_group_and_lr_edit_takes_effect():
    """G0 lr 1e-2 wd 0.1, G1 lr 1e-3, G2 lr 0; G1's lr edited through ``param_groups`` before the 4th step: the
    engine's ``get_lr()`` gives one value per group, the parameters equal the reference's, G2's stay bitwise at
    their initial values; stages 0 and 3, and stages 1-3 with the optimizer state offloaded to the host."""
    ref = pm.reference_run(dict(world=2, groups="lr", steps=4, lr_change=(3, 1, 5e-3)))
    initial = pm.build()
    for stage, offload in ((0, False), (3, False), (1, True), (2, True), (3, True)):
        for lrs, params in run_ranks(_lr_groups_body, 2, stage, offload, timeout=60):
            assert lrs == [[1e-2, 1e-3, 0.0], [1e-2, 5e-3, 0.0]], (stage, offload, lrs)
            for name, want in ref["params"].items():
                torch.testing.assert_close(params[name], want, **TOL, msg=f"stage {stage} offload {offload} {name}")
            assert torch.equal(params["l3.weight"], initial.l3.weight.detach()), (stage, offload)


def _overflow_body(stage: int, precision: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    model = pm.build()
    mp = {"bf16": {"enabled": True}} if precision == "bf16" else {
        "fp16": {"enabled": True, "initial_scale_power": 4, "hysteresis": 1, "loss_scale_window": 2}}  # fmt: skip
    eng = _engine(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), stage, scheduler=SCHED, **mp)
    dtype = torch.float16 if precision == "fp16" else torch.float32
    trace = []
    for step in range(3):
        x, y = pm.batch(step, 2, 1)
        loss = F.cross_entropy(eng(x[rank * 3 : rank * 3 + 3].to(dtype)).float(), y[rank * 3 : rank * 3 + 3])
        if step == 1 and rank == 1:
            loss = loss * float("nan")
        before = eng.runtime.full_parameters()
        eng.backward(loss)
        eng.step()
        after = eng.runtime.full_parameters()
        scale = eng.runtime.loss_scaler.scale
        trace.append((all(torch.equal(before[n], after[n]) for n in before), eng.skipped_steps,
                      eng.lr_scheduler.last_batch_iteration, eng.runtime.overflow, scale))  # fmt: skip
    return trace


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_overflow_skip_is_counted_scheduler_holds_and_params_unchanged(precision):
    for stage in (1, 3):
        for rank, trace in enumerate(run_ranks(_overflow_body, 2, stage, precision, timeout=60)):
            label = f"{precision} stage {stage} rank {rank}"
            unchanged, skipped, sched_iter, overflow, scale = zip(*trace)
            assert unchanged == (False, True, False), label
            assert skipped == (0, 1, 1) and overflow == (False, True, False), label
            assert sched_iter == (0, 0, 1), f"{label}: the scheduler advanced on the skipped step: {sched_iter}"
            if precision == "fp16":
                assert scale[1] == scale[0] / 2, f"{label}: scale {scale}"


class Rotary(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.arange(0, 64))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)))
        self.register_buffer("mask", torch.arange(8) % 2 == 0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        # buffers stay fp32/int64/bool; like HF's rotary code, cast to the weights' dtype before the matmul
        h = x * self.inv_freq * self.mask
        return self.lin(h.to(self.lin.weight.dtype)).float() + self.pos[:8].float()


def _buffers_body():
    import zero

    outs, bufs = [], []
    for partitioned in (False, True):
        torch.manual_seed(pm.SEED)
        with zero.Init(dtype=torch.bfloat16, enabled=partitioned):
            model = Rotary()
        built = {n: b.clone() for n, b in model.named_buffers()}
        eng = _engine(model, torch.optim.SGD(model.parameters(), lr=0.1), 3, bf16={"enabled": True})
        bufs.append((built, {n: b.clone() for n, b in eng.module.named_buffers()}))
        outs.append(eng(torch.ones(2, 8)).detach().float())
    return bufs, outs


def test_engine_bf16_keeps_buffers_and_zero_init_matches_plain_build():
    torch.manual_seed(pm.SEED)
    plain = dict(Rotary().named_buffers())
    for bufs, (out_plain, out_init) in run_ranks(_buffers_body, 2, timeout=60):
        for built, after_engine in bufs:
            for name, b in plain.items():
                for what, got in (("built", built[name]), ("after initialize", after_engine[name])):
                    assert got.dtype == b.dtype and torch.equal(got, b), f"{name} {what}: {got.dtype} vs {b.dtype}"
        torch.testing.assert_close(out_init, out_plain, rtol=2e-2, atol=1e-2)


def _noncontiguous_body(stage: int):
    import torch.distributed as dist

    model = pm.build("conv")
    if dist.get_rank() != 0:  # different init per rank: the engine must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    eng = _engine(model, pm.make_optimizer("adamw", model.parameters()), stage)
    init = eng.runtime.full_parameters()
    _train(eng, 3, 1, "conv")
    return init, eng.runtime.full_parameters()


def test_engine_initialize_noncontiguous_broadcasts_and_trains():
    initial = dict(pm.build("conv").named_parameters())
    ref = pm.reference_run(dict(world=2, model="conv", steps=3))
    for stage in (0, 1, 2, 3):
        for init, params in run_ranks(_noncontiguous_body, 2, stage, timeout=60):
            for name, p in initial.items():
                assert init[name].shape == p.shape and torch.equal(init[name], p.detach()), (stage, name)
            for name, want in ref["params"].items():
                torch.testing.assert_close(params[name], want, **TOL, msg=f"stage {stage} {name}")


BUCKET_FIELDS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")


def _bucket_sizes_body():
    import zero

    errors = {}
    for stage in (1, 2, 3):
        for field in BUCKET_FIELDS:
            for value in (0, -1, 1.5, "abc"):
                model = pm.build()
                try:
                    _engine(model, torch.optim.SGD(model.parameters(), lr=0.1), stage, zero={field: value})
                except zero.ConfigError as exc:
                    errors[(stage, field, str(value))] = str(exc)
                else:
                    errors[(stage, field, str(value))] = None
    big = 10 * 247
    trained = []
    for stage in (1, 2, 3):
        model = pm.build()
        eng = _engine(model, pm.make_optimizer("adamw", model.parameters()), stage,
                      zero=dict.fromkeys(BUCKET_FIELDS, big))  # fmt: skip
        losses = _train(eng, 3, 1)
        trained.append((stage, losses, eng.runtime.full_parameters()))
    return errors, trained


def test_engine_bad_bucket_sizes_name_the_field_and_big_buckets_train():
    ref = pm.reference_run(dict(world=2, steps=3))
    for errors, trained in run_ranks(_bucket_sizes_body, 2, timeout=60):
        for (stage, field, value), msg in errors.items():
            if field == "stage3_prefetch_bucket_size" and value == "0":  # DeepSpeed's "prefetch off"
                assert msg is None, f"stage {stage}: {field}=0 refused: {msg}"
                continue
            assert msg is not None, f"stage {stage}: {field}={value} was accepted"
            assert f"zero_optimization.{field}" in msg, f"stage {stage} {field}={value}: {msg}"
        for stage, _, params in trained:
            for name, want in ref["params"].items():
                torch.testing.assert_close(params[name], want, **TOL, msg=f"stage {stage} {name}")


def _batch_triple_body():
    import torch.distributed as dist

    import zero

    ws = dist.get_world_size()
    shapes = {
        "consistent": {
            "train_batch_size": 4 * 3 * ws,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 3,
        },  # fmt: skip
        "only_global": {"train_batch_size": 6 * ws},
        "only_micro": {"train_micro_batch_size_per_gpu": 5},
        "micro_gas": {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 4},
        "global_gas": {"train_batch_size": 8 * ws, "gradient_accumulation_steps": 2},
        "inconsistent": {
            "train_batch_size": 100,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 3,
        },
        "not_divisible": {"train_batch_size": 7 * ws + 1, "gradient_accumulation_steps": 1},
        "zero_micro": {"train_micro_batch_size_per_gpu": 0},
        "negative_gas": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": -1},
    }
    out = {}
    for name, batch in shapes.items():
        model = pm.build()
        try:
            eng = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config={**batch, "zero_optimization": {"stage": 2}})[0]  # fmt: skip
        except zero.ConfigError as exc:
            out[name] = ("error", str(exc))
        else:
            out[name] = ("ok", (eng.train_batch_size(), eng.train_micro_batch_size_per_gpu(),
                                eng.gradient_accumulation_steps()))  # fmt: skip
    return ws, out


@pytest.mark.parametrize("world", [2, 3])
def test_engine_batch_triple_is_consistent_at_ws(world):
    ws, out = run_ranks(_batch_triple_body, world, timeout=60)[0]
    assert ws == world
    want = {"consistent": (12 * ws, 4, 3), "only_global": (6 * ws, 6, 1), "only_micro": (5 * ws, 5, 1),
            "micro_gas": (20 * ws, 5, 4), "global_gas": (8 * ws, 4, 2)}  # fmt: skip
    for name, triple in want.items():
        assert out[name] == ("ok", triple), (name, out[name])
        g, m, a = out[name][1]
        assert g == m * a * ws, name
    for name in ("inconsistent", "not_divisible", "zero_micro", "negative_gas"):
        assert out[name][0] == "error", (name, out[name])
    msg = out["inconsistent"][1]
    # each number beside the key it came from, and the product the global batch must equal
    for text in ("train_batch_size=100", "train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=3",
                 f"world size {ws} (= {12 * ws})"):  # fmt: skip
        assert text in msg, (text, msg)
    assert "train_micro_batch_size_per_gpu" in out["zero_micro"][1]
    assert "gradient_accumulation_steps" in out["negative_gas"][1]
