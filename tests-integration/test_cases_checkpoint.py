"""Audit of the checkpoint cases (frozen parameters, consolidation, resharding) with *partitioned* stage-3 parameters.

zero-core's own checkpoint tests use models of a few hundred elements with the default
``stage3_param_persistence_threshold`` (100,000 elements), so at stage 3 every parameter there stays resident and the
size-0-placeholder fault (frozen params saved from their released, empty storage) is never exercised.
Here the threshold is 0: every parameter, frozen ones included, is released to its shard outside forward/backward.

* Frozen parameters survive: TinyNet with layer 1 frozen, ws=2, stage 3, fp32 and bf16 storage: train 2 steps, save,
  load into a fresh runtime whose weights differ, every parameter (frozen and trainable) equals its pre-save value
  bitwise, in the stored dtype too; the next step equals the uninterrupted run (bitwise).
* Consolidation: two param groups of uneven size plus the frozen layer and a buffer; offline consolidation
  and the running job's ``full_state_dict`` give exactly the model's keys at full shape, equal to the gathered
  masters, and load into a plain model with ``strict=True`` and into a partitioned stage-3 job (through
  ``GatheredParameters(modifier_rank=0)``), restoring every value.
* Resharding: the ws=2 stage-3 checkpoint loads at ws=3 (stage 3, threshold 0): parameters exact, next step equals the
  uninterrupted ws=2 run on the same global batch within 1e-6.
"""

import pathlib
import sys
import tempfile

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import parity_models as pm  # noqa: E402

GLOBAL = 12  # samples per step, divisible by 2 and 3


class FrozenTiny(pm.TinyNet):
    """TinyNet, layer 1 frozen, plus a running-stat style buffer added to the logits."""

    def __init__(self):
        super().__init__()
        self.l1.requires_grad_(False)
        self.register_buffer("running", torch.linspace(-0.5, 0.5, 4))

    def forward(self, x):
        return super().forward(x) + self.running


def _build(precision: str, perturb: bool):
    from zero_core import ZeroConfig, ZeroRuntime

    torch.manual_seed(pm.SEED)
    model = FrozenTiny()
    if perturb:  # a fresh job whose weights differ everywhere: everything must come from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
    groups = [{"params": [model.l2.weight, model.l3.bias]}, {"params": [model.l2.bias, model.l3.weight], "lr": 3e-3}]
    opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0)
    return ZeroRuntime(model, opt, cfg, pm.precision_of(precision))


def _train(rt, first: int, steps: int):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL // world
    for step in range(first, first + steps):
        x, y = pm.batch(step, 4, 1)  # 12 samples whatever the world size
        rt.backward(F.cross_entropy(rt.module(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]))
        rt.step()


def _stored(rt) -> dict:
    """Every parameter gathered through GatheredParameters, in the dtype the runtime stores/computes it in."""
    from zero_core import GatheredParameters

    params = dict(rt.module.named_parameters())
    with GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _save_body(root: str, precision: str):
    from zero_core import ShardState
    from zero_core.checkpoint import full_state_dict, load_checkpoint, save_checkpoint

    control = _build(precision, False)
    _train(control, 0, 3)
    want = control.full_parameters()

    run = _build(precision, False)
    _train(run, 0, 2)
    assert all(run.params.state_of(b) is ShardState.SHARDED for g in run.flat_groups for b in g.buckets), "released"
    before, before_stored = run.full_parameters(), _stored(run)
    live = full_state_dict(run)
    save_checkpoint(run, f"{root}/{precision}", "step2")

    fresh = _build(precision, True)
    load_checkpoint(fresh, f"{root}/{precision}")
    after, after_stored = fresh.full_parameters(), _stored(fresh)
    _train(fresh, 2, 1)
    return before, before_stored, after, after_stored, fresh.full_parameters(), want, live


def _load_body(root: str, precision: str):
    from zero_core.checkpoint import load_checkpoint

    fresh = _build(precision, True)
    load_checkpoint(fresh, f"{root}/{precision}")
    loaded = fresh.full_parameters()
    _train(fresh, 2, 1)
    return loaded, fresh.full_parameters()


def _load_consolidated_body(path: str, precision: str):
    """The consolidated file loads into a job that is itself partitioned (stage 3, threshold
    0), through DeepSpeed's load path for that case: ``GatheredParameters(modifier_rank=0)`` around
    ``module.load_state_dict`` (what transformers' ``from_pretrained`` does under ZeRO-3)."""
    from zero_core import GatheredParameters

    fresh = _build(precision, True)
    state = load_file(path)
    with GatheredParameters(list(fresh.module.parameters()), modifier_rank=0):
        fresh.module.load_state_dict(state, strict=True)
    return fresh.full_parameters(), _stored(fresh), fresh.module.running.clone()


def test_stage3_partitioned_frozen_params_survive_save_load_consolidate_reshard():
    from zero_core.checkpoint import consolidate

    with tempfile.TemporaryDirectory() as root:
        for precision in ("fp32", "bf16"):
            results = run_ranks(_save_body, 2, root, precision, timeout=90)
            for rank, (before, before_st, after, after_st, next_step, want, _live) in enumerate(results):
                label = f"{precision} rank {rank}"
                for name, p in before.items():  # bitwise, frozen l1 included
                    assert after[name].shape == p.shape and torch.equal(after[name], p), f"{label}: {name}"
                    assert after_st[name].dtype == before_st[name].dtype, f"{label}: {name} dtype"
                    assert torch.equal(after_st[name], before_st[name]), f"{label}: stored {name}"
                for name, p in want.items():  # next step equals the uninterrupted run
                    assert torch.equal(next_step[name], p), f"{label}: step 3 {name}"
            before, _, _, _, _, _, live = results[0]
            torch.manual_seed(pm.SEED)
            frozen_l1 = FrozenTiny().l1.weight.detach()
            keys = list(FrozenTiny().state_dict())
            # offline consolidation, and the running job's full state dict
            out_file = str(consolidate(f"{root}/{precision}", f"{root}/{precision}-out"))
            state = load_file(out_file)
            for what, sd in (("consolidated", state), ("full_state_dict", live)):
                assert list(sd) == keys, f"{precision} {what}: keys {list(sd)}"
                for name, p in before.items():
                    assert sd[name].shape == p.shape, f"{precision} {what}: {name} shape {tuple(sd[name].shape)}"
                    assert torch.equal(sd[name].float(), p), f"{precision} {what}: {name}"
                assert torch.equal(sd["running"], torch.linspace(-0.5, 0.5, 4)), f"{precision} {what}: buffer"
            assert torch.equal(state["l1.weight"], frozen_l1.to(pm.precision_of(precision).param_dtype).float())
            FrozenTiny().load_state_dict(state, strict=True)
            # the consolidated file loaded into a partitioned job restores every value (the stored dtype rounds bf16's)
            into_partitioned = run_ranks(_load_consolidated_body, 2, out_file, precision, timeout=90)
            for rank, (masters, stored, running) in enumerate(into_partitioned):
                label = f"{precision} rank {rank}: consolidated into a partitioned job"
                assert torch.equal(running, state["running"]), label
                param_dtype = pm.precision_of(precision).param_dtype
                for name, p in before.items():
                    want_stored = state[name].to(param_dtype).to(stored[name].dtype)
                    assert torch.equal(stored[name], want_stored), f"{label}: stored {name}"
                    if precision == "fp32":
                        assert torch.equal(masters[name], p), f"{label}: {name}"
            # the ws=2 checkpoint resumes at ws=3 (stage 3, partitioned)
            want = results[0][5]
            for rank, (loaded, next_step) in enumerate(run_ranks(_load_body, 3, root, precision, timeout=90)):
                for name, p in before.items():
                    assert torch.equal(loaded[name], p), f"{precision} ws3 rank {rank}: loaded {name}"
                tol = dict(atol=1e-6, rtol=1e-5) if precision == "fp32" else dict(atol=2e-2, rtol=0)
                for name, p in want.items():
                    torch.testing.assert_close(next_step[name], p, **tol, msg=f"{precision} ws3 rank {rank}: {name}")
