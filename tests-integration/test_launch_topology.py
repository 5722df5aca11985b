"""hpZ's secondary groups follow the launch: with ``zero_hpz_partition_size: "auto"`` each secondary (intra-node)
group is the ranks of one node (torchrun's LOCAL_WORLD_SIZE), and training still matches an explicit size."""

import os

import torch

import zero
from zero_comm.testing import run_ranks


def hpz_body(hpz, local_world_size: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)  # what torchrun sets on each node
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    zero_section = {"stage": 3, "zero_hpz_partition_size": hpz, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": zero_section}  # fmt: skip
    engine = zero.initialize(model=net, config=cfg)[0]
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + torch.distributed.get_rank())
        engine.backward(engine(torch.randn(2, 8, generator=g)).square().mean())
        engine.step()
    groups = engine.runtime.zeropp.groups
    with torch.no_grad():
        out = engine(torch.ones(1, 8)).tolist()
    return {"hpz": engine.config.zero_optimization.zero_hpz_partition_size, "intra": groups.intra_ranks,
            "num_nodes": groups.num_nodes, "out": out}  # fmt: skip


def test_hpz_auto_is_intra_node():
    auto = run_ranks(hpz_body, 4, "auto", 2, timeout=120)
    assert [o["intra"] for o in auto] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert all(o["hpz"] == 2 and o["num_nodes"] == 2 for o in auto)
    explicit = run_ranks(hpz_body, 4, 2, 2, timeout=120)
    assert [o["out"] for o in auto] == [o["out"] for o in explicit]
