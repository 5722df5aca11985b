"""A forward-only ZeRO-3 engine (no optimizer: a reference, teacher or evaluation model) whose small parameters stay
gathered (the default ``stage3_param_persistence_threshold``): a write into one outside ``GatheredParameters`` on one
rank only would leave the ranks computing with different values, with no ``step()`` to catch it. The next forward
raises PartitionedWriteError on every rank naming the parameter, before computing; the same write inside
``GatheredParameters(modifier_rank=0)`` reaches every rank and the forward runs, the outputs equal on both ranks."""

import torch
import torch.distributed as dist

import zero
from zero_comm.testing import run_ranks
from zero_core.partitioned_param import PartitionedWriteError


def _forward_only() -> dict:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    engine = zero.initialize(model=net, config={"train_micro_batch_size_per_gpu": 2,
                                                "zero_optimization": {"stage": 3}})[0]  # fmt: skip
    x = torch.ones(2, 8)
    out = {"before": engine(x).detach().clone()}
    if dist.get_rank() == 1:
        with torch.no_grad():
            net[0].bias.add_(1.0)  # this rank only, outside a gather
    try:
        engine(x)
        out["error"] = None
    except PartitionedWriteError as e:
        out["error"] = str(e)
    with torch.no_grad(), zero.GatheredParameters([net[0].bias], modifier_rank=0):
        net[0].bias.fill_(0.5)  # rank 0's value goes to every rank (rank 1's stray write is replaced)
    out["after"] = engine(x).detach().clone()
    gathered = [torch.zeros_like(out["after"]) for _ in range(2)]
    dist.all_gather(gathered, out["after"])
    out["same_on_ranks"] = torch.equal(gathered[0], gathered[1])
    out["changed"] = not torch.equal(out["before"], out["after"])
    return out


def test_a_stray_write_on_one_rank_stops_the_next_forward_on_every_rank():
    for rank, out in enumerate(run_ranks(_forward_only, 2, timeout=120)):
        assert out["error"] is not None, rank
        assert "'0.bias' of shape (8,)" in out["error"] and "without an optimizer" in out["error"], out["error"]
        assert "GatheredParameters(params, modifier_rank=0)" in out["error"], out["error"]
        assert out["same_on_ranks"] and out["changed"], (rank, out)
