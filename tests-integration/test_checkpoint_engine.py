"""Engine-level checkpoints: ``zero.initialize`` -> train -> ``save_checkpoint`` -> fresh engine ``load_checkpoint``
-> continue equals the uninterrupted run bitwise (params, LR, counters), at stages 1-3 on 2 ranks (one launch); then
``zero consolidate`` writes a state dict that loads with ``strict=True`` into the plain model.

The same launch resumes zero's own Adam (the ``optimizer`` section without ``torch_adam``: zero_kernels' CPU Adam,
``step`` per parameter), AdamW with ``betas=(0.9, 0.95)``: 5 steps, save, load into a fresh engine, 3 more equal 8
uninterrupted steps bitwise; right after the load the optimizer state (``step`` included) and the param groups'
hyper-parameters equal the saved engine's; ``load_optimizer_states=False`` leaves no state (``step`` back to 0).

An fp16 run with dynamic loss scaling (window 3, hysteresis 2, overflows at steps 2 and 3) saved at step 5 (scale
below the initial one, two good steps into the window) and resumed in a fresh engine keeps the scaler's state, its
scale and skip decisions, the scheduler's lr and the parameters of the uninterrupted run (stages 2 and 3, the same
launch).
"""

import os
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

import zero
from zero.cli import main as cli_main
from zero_comm.testing import run_ranks
from zero_kernels import CPUAdam

STAGES = (1, 2, 3)
TORCH_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
OWN_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.01}}
FP16_STAGES = (2, 3)

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import parity_models as pm  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(6, 9)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
        self.register_buffer("shift", torch.linspace(0, 1, 3))

    def forward(self, x):
        return self.body(torch.tanh(self.frozen(x))) + self.shift


def config(stage, optimizer=TORCH_ADAMW, scheduler=True):
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage},
    }
    if scheduler:
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        }  # fmt: skip
    return cfg


def engine(stage, seed, **kw):
    torch.manual_seed(seed)
    eng, *_ = zero.initialize(model=Net(), config=config(stage, **kw))
    return eng


def train(eng, first, steps):
    lrs = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step * 31 + dist.get_rank())
        loss = eng(torch.randn(4, 6, generator=g)).pow(2).mean()
        eng.backward(loss)
        eng.step()
        lrs.append(eng.get_lr()[0])
    return lrs


def optimizer_state(eng) -> dict:
    """This rank's master shards, optimizer state per flat group (shard layout) and param-group hyper-parameters."""
    rt, out = eng.runtime, {}
    for g in rt.flat_groups:
        if g.group_index is not None:
            out[f"master/{g.index}"] = rt.master.master_shard(g).detach().clone()
            out.update({f"optim/{g.index}/{k}": v.clone() for k, v in rt.master.state_shard(g).items()})
    out["groups"] = [{k: v for k, v in pg.items() if k != "params"} for pg in eng.optimizer.param_groups]
    return out


def step_counts(state: dict) -> set[int]:
    """The distinct ``step`` values of stepped elements. The frozen layer shares the trainable layers' param group
    (``model.parameters()``), so its elements hold step 0 per element: never stepped, as torch's AdamW."""
    steps = [v.reshape(-1) for k, v in state.items() if k.endswith("/step")]
    return {int(x) for x in torch.cat(steps).tolist()} - {0} if steps else set()


def assert_same(a, b, what):
    assert a.keys() == b.keys(), f"{what}: keys {sorted(a.keys() ^ b.keys())}"
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert same, f"{what}: {k}: {a[k]} != {b[k]}"


def _torch_adam_resume(root, stage):
    control = engine(stage, 0)
    expected_lrs = train(control, 0, 5)

    run = engine(stage, 0)
    head = train(run, 0, 3)
    saved = run.save_checkpoint(root, client_state={"epoch": 2})
    fresh = engine(stage, 77)
    path, client = fresh.load_checkpoint(root)
    assert saved is True and client == {"epoch": 2} and fresh.global_steps == 3
    assert path == os.path.join(root, "global_step3", "mp_rank_00_model_states.safetensors"), path
    tail = train(fresh, 3, 2)
    assert head + tail == expected_lrs
    assert fresh.global_steps == control.global_steps == 5
    for (name, a), b in zip(fresh.module.state_dict().items(), control.module.state_dict().values()):
        assert torch.equal(a, b), f"stage {stage}: {name}"
    return {k: v.detach().float().clone() for k, v in run.runtime.full_parameters().items()}  # at the checkpoint


def _own_adam_resume(root, stage):
    what = f"zero's Adam, stage {stage}, rank {dist.get_rank()}"
    own = dict(optimizer=OWN_ADAMW, scheduler=False)
    control = engine(stage, 0, **own)
    train(control, 0, 8)

    run = engine(stage, 0, **own)
    train(run, 0, 5)
    run.save_checkpoint(root, tag="five")
    saved = optimizer_state(run)
    fresh = engine(stage, 77, **own)
    assert isinstance(fresh.optimizer, CPUAdam), type(fresh.optimizer)
    fresh.load_checkpoint(root, tag="five")
    after = optimizer_state(fresh)
    assert_same(after, saved, f"{what}: right after load")
    assert after["groups"][0]["betas"] == (0.9, 0.95), after["groups"]
    assert step_counts(after) == {5}, f"{what}: steps {step_counts(after)}"
    train(fresh, 5, 3)
    for (name, a), b in zip(fresh.module.state_dict().items(), control.module.state_dict().values()):
        assert torch.equal(a, b), f"{what}: {name} after 5+3 steps"  # bitwise (the case allows 1e-6)

    nostate = engine(stage, 5, **own)
    train(nostate, 50, 1)  # a trained engine: its state must go
    nostate.load_checkpoint(root, tag="five", load_optimizer_states=False)
    left = optimizer_state(nostate)
    assert not [k for k in left if k.startswith("optim/")], f"{what}: state left {sorted(left)}"
    assert left["groups"] == optimizer_state(engine(stage, 5, **own))["groups"], what  # as constructed
    assert_same({k: v for k, v in left.items() if k.startswith("master/")},
                {k: v for k, v in saved.items() if k.startswith("master/")}, f"{what}: masters")  # fmt: skip
    train(nostate, 5, 1)
    steps = step_counts(optimizer_state(nostate))
    assert steps == {1}, f"{what}: step after load_optimizer_states=False then one step: {steps}"


OVERFLOW_AT = (2, 3)  # rank 1's loss times inf
SKIP_AT = 9  # an injected overflow after the resume too
PROBE_AT, PROBE = 6, 1000.0  # see fp16_train


def fp16_engine(stage, seed):
    torch.manual_seed(seed)
    cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2,
                                                        "warmup_num_steps": 10, "warmup_type": "linear"}},
           "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 3, "hysteresis": 2},
           "zero_optimization": {"stage": stage}}  # fmt: skip
    return zero.initialize(model=pm.TinyNet(), config=cfg)[0]


def fp16_train(eng, first, last):
    """Steps first..last (1-based) on TinyNet's batches; per step (scale, overflow, skipped steps, lr) after it."""
    rank = dist.get_rank()
    trace = []
    for step in range(first, last + 1):
        x, y = pm.batch(step, 2, 1)
        out = eng(x[rank * 3 : rank * 3 + 3])
        loss = F.cross_entropy(out.float(), y[rank * 3 : rank * 3 + 3])
        if step in (*OVERFLOW_AT, SKIP_AT) and rank == 1:
            loss = loss * float("inf")
        if step == PROBE_AT:
            # logit 0's bias gets 3 x PROBE x the loss scale on each rank, summed over the 2 ranks in fp16: 48000
            # at the trained scale 8, inf at the initial 16 (a resume at the initial scale skips the step and the
            # scheduler falls a step behind, as the user saw)
            loss = loss + PROBE * out[:, 0].float().sum()
        eng.backward(loss)
        eng.step()
        trace.append((eng.runtime.loss_scaler.scale, eng.runtime.overflow, eng.skipped_steps, eng.get_lr()[0]))
    return trace


def _fp16_body(root, stage):
    control = fp16_engine(stage, pm.SEED)
    expected = fp16_train(control, 1, 10)
    run = fp16_engine(stage, pm.SEED)
    head = fp16_train(run, 1, 5)
    saved = dict(run.runtime.loss_scaler.state_dict())
    run.save_checkpoint(root)
    fresh = fp16_engine(stage, 77)
    fresh.load_checkpoint(root)
    loaded = dict(fresh.runtime.loss_scaler.state_dict())
    tail = fp16_train(fresh, 6, 10)
    want, got = control.runtime.full_parameters(), fresh.runtime.full_parameters()
    return saved, loaded, head + tail, expected, {n: torch.equal(v, want[n]) for n, v in got.items()}


def _body(root):
    """Per stage: the torch-AdamW resume's parameters at the checkpoint, and at FP16_STAGES the fp16 resume's trace."""
    out = {}
    for stage in STAGES:
        params = _torch_adam_resume(f"{root}/s{stage}", stage)
        _own_adam_resume(f"{root}/own-s{stage}", stage)
        out[stage] = params, (_fp16_body(f"{root}/fp16-s{stage}", stage) if stage in FP16_STAGES else None)
    return out


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """(checkpoint root, per-rank results of ``_body``): one 2-rank launch for every test of this file."""
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_ranks(_body, 2, root, timeout=240)


def test_engine_resume_and_cli_consolidation(launch):
    root, results = launch
    for stage, (params, _) in results[0].items():
        assert cli_main(["consolidate", f"{root}/s{stage}", f"{root}/out{stage}"]) == 0
        state = load_file(f"{root}/out{stage}/model.safetensors")
        plain = Net()
        plain.load_state_dict(state, strict=True)
        assert torch.equal(state["shift"], torch.linspace(0, 1, 3))
        for name, value in params.items():
            assert torch.equal(state[name], value), f"stage {stage}: {name}"


@pytest.mark.parametrize("stage", FP16_STAGES)
def test_fp16_resume_keeps_loss_scale_skips_and_lr_of_the_uninterrupted_run(stage, launch):
    for rank, per_stage in enumerate(launch[1]):
        saved, loaded, resumed, expected, same = per_stage[stage][1]
        label = f"stage {stage} rank {rank}"
        # the uninterrupted run: overflows at 2 and 3 (hysteresis 2: the second halves 16 to 8), good steps 4-8
        # (the window of 3 doubles the scale after step 7), the probe step 6 passes at scale 8, overflow at 9
        scales, overflows, skipped, lrs = zip(*expected)
        assert scales == (16, 16, 8, 8, 8, 8, 16, 16, 16, 16), f"{label}: {scales}"
        assert overflows == (False, True, True, False, False, False, False, False, True, False), label
        assert skipped[-1] == 3, f"{label}: {skipped}"
        rises = [b > a for a, b in zip(lrs, lrs[1:])]
        assert rises == [False, False, True, True, True, True, True, False, True], f"{label}: {lrs}"  # held on skips
        # at the checkpoint: scale below the initial 16, the hysteresis spent, two good steps since the overflow
        assert saved["scale"] == 8 and saved["cur_hysteresis"] == 1, f"{label}: {saved}"
        assert saved["cur_iter"] - saved["last_overflow_iter"] - 1 == 2, f"{label}: {saved}"
        assert loaded == saved, f"{label}: loaded {loaded}, saved {saved}"
        assert resumed == expected, f"{label}: resumed {resumed}\nexpected {expected}"
        assert all(same.values()), f"{label}: params differ from the uninterrupted run: {same}"
