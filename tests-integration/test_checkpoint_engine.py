"""Engine-level checkpoints: ``zero.initialize`` -> train -> ``save_checkpoint`` -> fresh engine ``load_checkpoint``
-> continue equals the uninterrupted run bitwise (params, LR, counters), at stages 1-3 on 2 ranks (one launch); then
``zero consolidate`` writes a state dict that loads with ``strict=True`` into the plain model.

The same launch resumes zero's own Adam (the ``optimizer`` section without ``torch_adam``: zero_kernels' CPU Adam,
``step`` per parameter), AdamW with ``betas=(0.9, 0.95)``: 5 steps, save, load into a fresh engine, 3 more equal 8
uninterrupted steps bitwise; right after the load the optimizer state (``step`` included) and the param groups'
hyper-parameters equal the saved engine's; ``load_optimizer_states=False`` leaves no state (``step`` back to 0).
"""

import os
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero
from zero.cli import main as cli_main
from zero_comm.testing import run_ranks
from zero_kernels import CPUAdam

STAGES = (1, 2, 3)
TORCH_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}}
OWN_ADAMW = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.01}}


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


def _body(root):
    params = {}
    for stage in STAGES:
        params[stage] = _torch_adam_resume(f"{root}/s{stage}", stage)
        _own_adam_resume(f"{root}/own-s{stage}", stage)
    return params


def test_engine_resume_and_cli_consolidation():
    with tempfile.TemporaryDirectory() as root:
        at_checkpoint = run_ranks(_body, 2, root, timeout=180)[0]
        for stage, params in at_checkpoint.items():
            assert cli_main(["consolidate", f"{root}/s{stage}", f"{root}/out{stage}"]) == 0
            state = load_file(f"{root}/out{stage}/model.safetensors")
            plain = Net()
            plain.load_state_dict(state, strict=True)
            assert torch.equal(state["shift"], torch.linspace(0, 1, 3))
            for name, value in params.items():
                assert torch.equal(state[name], value), f"stage {stage}: {name}"
