"""``engine.save_checkpoint(..., exclude_frozen_parameters=True)`` (DeepSpeed's argument; transformers' Trainer passes
it for PEFT models): the frozen-only flat group is not written, a load keeps the module's frozen values, training
resumes bitwise as from a full checkpoint, and consolidation (``zero consolidate``, ``zero_to_fp32``) omits the
frozen names. Stages 1 and 3 on 2 ranks, and the 2-rank checkpoint loaded on 1 rank (resharding)."""

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

import zero
from zero.checkpoint_tools.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero.cli import main as cli_main
from zero_comm.testing import run_ranks
from zero_core.checkpoint import LayoutMismatchError, storage

FROZEN = ["frozen.weight", "frozen.bias"]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(6, 9)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(9, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3))
        self.register_buffer("shift", torch.linspace(0, 1, 3))

    def forward(self, x):
        return self.body(torch.tanh(self.frozen(x))) + self.shift


def make_net(seed, frozen_seed):
    """Trainable weights from ``seed``, frozen ones from ``frozen_seed`` (a PEFT base model reloaded from disk)."""
    torch.manual_seed(frozen_seed)
    frozen = Net().frozen.state_dict()
    torch.manual_seed(seed)
    net = Net()
    net.frozen.load_state_dict(frozen)
    return net


def engine(stage, seed, frozen_seed=0):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    net = make_net(seed, frozen_seed)
    # as transformers' Trainer builds its optimizer: trainable parameters only, so the frozen ones form their
    # own flat group outside the optimizer
    trainable = [p for p in net.parameters() if p.requires_grad]
    eng, *_ = zero.initialize(model=net, model_parameters=trainable, config=config)
    return eng


def train(eng, first, steps):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(step * 31 + dist.get_rank())
        loss = eng(torch.randn(4, 6, generator=g)).pow(2).mean()
        eng.backward(loss)
        eng.step()


def frozen_values(eng):
    full = eng.runtime.full_parameters()
    return {n: full[n].detach().clone() for n in FROZEN}


def _body(root, stage):
    control = engine(stage, 0)
    train(control, 0, 5)

    run = engine(stage, 0)
    train(run, 0, 3)
    run.save_checkpoint(f"{root}/full", tag="t")
    run.save_checkpoint(f"{root}/ex", tag="t", exclude_frozen_parameters=True)
    at_save = {k: v.detach().clone() for k, v in run.runtime.full_parameters().items()}

    # a fresh engine with other trainable weights and the same frozen ones resumes bitwise
    fresh = engine(stage, 77)
    fresh.load_checkpoint(f"{root}/ex")
    assert fresh.global_steps == 3
    train(fresh, 3, 2)
    for (name, a), b in zip(fresh.module.state_dict().items(), control.module.state_dict().values()):
        assert torch.equal(a, b), f"stage {stage}: {name}"

    # frozen values missing from the checkpoint stay as the module holds them; a full checkpoint overwrites them
    other = engine(stage, 77, frozen_seed=5)
    before = frozen_values(other)
    assert not torch.equal(before["frozen.weight"], at_save["frozen.weight"])
    other.load_checkpoint(f"{root}/ex")
    after = frozen_values(other)
    full = other.runtime.full_parameters()
    for name in FROZEN:
        assert torch.equal(after[name], before[name]), name
    for name in ("body.0.weight", "body.2.bias"):
        assert torch.equal(full[name], at_save[name]), name
    other.load_checkpoint(f"{root}/full")
    assert torch.equal(frozen_values(other)["frozen.weight"], at_save["frozen.weight"])
    return {k: v.float() for k, v in at_save.items()}


def _reshard_body(root, stage, at_save):
    """The 2-rank excluded checkpoint on 1 rank: trainable values from it, frozen ones kept."""
    eng = engine(stage, 77, frozen_seed=5)
    before = frozen_values(eng)
    eng.load_checkpoint(f"{root}/ex")
    full = eng.runtime.full_parameters()
    for name, value in at_save.items():
        want = before[name] if name in FROZEN else value
        assert torch.equal(full[name].float(), want.float()), name
    # the excluded parameters unfrozen (now in the optimizer's flat group): refused, naming them
    net = make_net(77, 0).requires_grad_(True)
    unfrozen, *_ = zero.initialize(model=net, config={"train_micro_batch_size_per_gpu": 4,
                                                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                                                      "zero_optimization": {"stage": stage}})  # fmt: skip
    with pytest.raises(LayoutMismatchError, match=r"exclude_frozen_parameters=True and lacks \['frozen.bias'"):
        unfrozen.load_checkpoint(f"{root}/ex")


def rank_keys(path):
    """Every tensor key of every rank's shard file, and their total size in bytes."""
    keys, size = set(), 0
    for f in sorted(Path(path).glob("zero_pp_rank_*_optim_states.safetensors")):
        size += f.stat().st_size
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    return keys, size


@pytest.mark.parametrize("stage", [1, 3])
def test_exclude_frozen_parameters(stage):
    with tempfile.TemporaryDirectory() as root:
        at_save = run_ranks(_body, 2, root, stage, timeout=180)[0]

        meta = json.loads((Path(root) / "ex/t" / f"{storage.MODEL_STATES}.json").read_text())
        frozen_keys = [g["key"] for g in meta["layout"]["groups"] if g["optim_group"] is None]
        assert meta["excluded_frozen"] == FROZEN and len(frozen_keys) == 1
        full_keys, full_size = rank_keys(f"{root}/full/t")
        ex_keys, ex_size = rank_keys(f"{root}/ex/t")
        assert f"master/{frozen_keys[0]}" in full_keys and full_keys - ex_keys == {f"master/{frozen_keys[0]}"}
        assert ex_size <= full_size - 54 * 4  # 6x9 + 9 fp32 elements left out (54 at least)
        assert json.loads((Path(root) / "full/t" / f"{storage.MODEL_STATES}.json").read_text())["excluded_frozen"] == []

        run_ranks(_reshard_body, 1, root, stage, at_save, timeout=120)

        # consolidation: the excluded checkpoint lacks the frozen names; the full one has them unless asked not to
        assert cli_main(["consolidate", f"{root}/ex", f"{root}/out"]) == 0
        cli = load_file(f"{root}/out/model.safetensors")
        dense = get_fp32_state_dict_from_zero_checkpoint(f"{root}/ex")
        full = get_fp32_state_dict_from_zero_checkpoint(f"{root}/full")
        full_ex = get_fp32_state_dict_from_zero_checkpoint(f"{root}/full", exclude_frozen_parameters=True)
        trainable = sorted(set(at_save) - set(FROZEN))
        assert sorted(cli) == sorted(dense) == sorted(full_ex) == sorted(trainable + ["shift"])
        assert sorted(full) == sorted(trainable + FROZEN + ["shift"])
        for name in trainable:
            assert torch.equal(cli[name], at_save[name]) and torch.equal(dense[name], at_save[name]), name
        assert torch.equal(full["frozen.weight"], at_save["frozen.weight"])
        missing, unexpected = Net().load_state_dict(dense, strict=False)
        assert sorted(missing) == sorted(FROZEN) and not unexpected
