"""Writes into stage-3 parameters after the runtime is built, as Hugging Face ``_init_weights`` code does them.

A model with ``fc = Linear(8, 8)`` and ``fc2 = Linear(8, 1)``, every parameter sharded, outside any gather:
``nn.init.constant_(fc.weight, 0.5)``, ``fc.bias.data.fill_(0.25)`` and ``nn.init.kaiming_uniform_(fc2.weight)``.
Each either takes effect on every rank or raises ``PartitionedWriteError`` naming the parameter, its shape and the
fix (``GatheredParameters``); none is dropped silently (the write through ``.data`` wrote into the 0-element
placeholder and vanished). The same writes inside ``GatheredParameters(modifier_rank=0)`` take rank 0's values on
every rank, the random one included (ranks draw from different generator states). With parameters small enough to
stay gathered (the default ``stage3_param_persistence_threshold``) the writes land in each rank's copy only, and
the next step raises on every rank naming them rather than undoing them.
"""

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, ZeroConfig, ZeroRuntime
from zero_core.partitioned_param import PartitionedWriteError


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc(x)))


def _writes(model: _Net) -> dict:
    return {
        "constant_(fc.weight)": lambda: nn.init.constant_(model.fc.weight, 0.5),
        "fc.bias.data.fill_": lambda: model.fc.bias.data.fill_(0.25),
        "kaiming_uniform_(fc2.weight)": lambda: nn.init.kaiming_uniform_(model.fc2.weight),
    }


def _persistent() -> dict:
    """The same writes with the default persistence threshold: every parameter stays gathered between uses, so
    the writes land in this rank's gathered copy; the next step refuses on every rank, naming them, instead of
    restoring them from the master without a word."""
    torch.manual_seed(0)
    model = _Net()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    before = rt.full_parameters()
    torch.manual_seed(100 + dist.get_rank())
    for write in _writes(model).values():
        write()
    rt.backward(model(torch.ones(2, 8)).sum())
    try:
        rt.step()
        error = None
    except PartitionedWriteError as e:
        error = str(e)
    unchanged = all(torch.equal(v, before[k]) for k, v in rt.full_parameters().items())
    return {"error": error, "unchanged": unchanged}


def _body() -> dict:
    torch.manual_seed(0)
    model = _Net()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0))  # fmt: skip
    before = rt.full_parameters()
    errors = {}
    for what, write in _writes(model).items():
        try:
            write()
            errors[what] = None
        except PartitionedWriteError as e:
            errors[what] = str(e)
    unchanged = all(torch.equal(v, before[k]) for k, v in rt.full_parameters().items())
    torch.manual_seed(100 + dist.get_rank())  # each rank draws differently: rank 0's draw must win
    with GatheredParameters(list(model.parameters()), modifier_rank=0):
        for write in _writes(model).values():
            write()
        drawn = model.fc2.weight.detach().clone()
    return {"errors": errors, "unchanged": unchanged, "drawn": drawn, "after": rt.full_parameters(),
            "persistent": _persistent()}  # fmt: skip


def test_writes_outside_a_gather_raise_naming_the_parameter_and_inside_reach_every_rank():
    outs = run_ranks(_body, 2, timeout=120)
    shapes = {"constant_(fc.weight)": ("'fc.weight'", "(8, 8)"), "fc.bias.data.fill_": ("'fc.bias'", "(8,)"),
              "kaiming_uniform_(fc2.weight)": ("'fc2.weight'", "(1, 8)")}  # fmt: skip
    for rank, out in enumerate(outs):
        for what, (name, shape) in shapes.items():
            msg = out["errors"][what]
            assert msg is not None, f"rank {rank}: {what} was neither applied nor refused"
            assert name in msg and shape in msg and "GatheredParameters" in msg, (rank, what, msg)
        assert out["unchanged"], f"rank {rank}: a refused write changed a value"
        after = out["after"]
        assert torch.equal(after["fc.weight"], torch.full((8, 8), 0.5))
        assert torch.equal(after["fc.bias"], torch.full((8,), 0.25))
        torch.testing.assert_close(after["fc2.weight"], outs[0]["drawn"], rtol=0, atol=0)
        persistent = out["persistent"]
        assert persistent["error"] is not None, f"rank {rank}: the step undid writes into persistent parameters"
        for name, shape in shapes.values():
            assert name in persistent["error"] and shape in persistent["error"], (rank, persistent["error"])
        assert "GatheredParameters" in persistent["error"] and persistent["unchanged"]
    assert not torch.equal(outs[0]["drawn"], outs[1]["drawn"])  # the ranks did draw differently
