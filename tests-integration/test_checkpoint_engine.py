"""Engine-level checkpoints: ``zero.initialize`` -> train -> ``save_checkpoint`` -> fresh engine ``load_checkpoint``
-> continue equals the uninterrupted run bitwise (params, LR, counters), at stages 2 and 3 on 2 ranks; then
``zero consolidate`` writes a state dict that loads with ``strict=True`` into the plain model."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero
from zero.cli import main as cli_main
from zero_comm.testing import run_ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(6, 9)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
        self.register_buffer("shift", torch.linspace(0, 1, 3))

    def forward(self, x):
        return self.body(torch.tanh(self.frozen(x))) + self.shift


def config(stage):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "linear"},
        },  # fmt: skip
        "zero_optimization": {"stage": stage},
    }


def engine(stage, seed):
    torch.manual_seed(seed)
    eng, *_ = zero.initialize(model=Net(), config=config(stage))
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


def _body(root, stage):
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


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_resume_and_cli_consolidation(stage):
    with tempfile.TemporaryDirectory() as root:
        params = run_ranks(_body, 2, root, stage, timeout=180)[0]
        assert cli_main(["consolidate", root, f"{root}/out"]) == 0
        state = load_file(f"{root}/out/model.safetensors")
        plain = Net()
        plain.load_state_dict(state, strict=True)
        assert torch.equal(state["shift"], torch.linspace(0, 1, 3))
        for name, value in params.items():
            assert torch.equal(state[name], value), name
