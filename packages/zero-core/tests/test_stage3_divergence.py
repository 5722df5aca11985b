"""Stage-3 ranks that run different modules, after the recording pass: O(1) check collectives per step, and ranks
that leave the recorded order still raise RankDivergenceError on every rank (never a hang, never a gloo abort)."""

import torch
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import RankDivergenceError, ZeroConfig, ZeroRuntime

CHECK_BYTES = 4 * 8 * 2  # a divergence check: 4 int64 per rank, 2 ranks (output bytes of the all-gather)


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({"body": nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]), "head": nn.Linear(6, 6)})


def _steady_body():
    model = _model()
    # reuse distance 1: only the forward's last unit stays gathered for backward (DeepSpeed's 1e9 keeps all)
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=1)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    units = sum(len(g.buckets) for g in rt.flat_groups)
    per_step = []
    for _ in range(4):
        with CommsLogger() as log:
            out = rt.module["head"](rt.module["body"](torch.ones(3, 6)))
            rt.backward(out.square().mean())
            rt.step()
        checks = [r for r in log.records if r.dtype == "torch.int64" and r.logical_bytes == CHECK_BYTES]
        gathers = [r for r in log.records if r.name == "all_gather_into_tensor" and r.dtype != "torch.int64"]
        per_step.append((len(checks), len(gathers)))
    return units, per_step


def test_steady_steps_check_once_per_step_not_per_gather():
    for units, per_step in run_ranks(_steady_body, 2, timeout=60):
        assert units == 5
        # recording step: one check per unit gather (forward and backward) + the forward-order check; backward
        # prefetches 4 units in 2 collectives (the next alone, then the other 3 together: zero_core.gather_batch)
        assert per_step[0] == (2 * units + 1, 2 * units - 2)
        # afterwards: the unit gathers alone, plus one forward-order check: forward 3 collectives (first unit, next
        # unit, the other 3), backward 2 (the forward's last unit stays gathered for it)
        assert per_step[1:] == [(1, 5)] * 3


def _diverge_body(mode, prefetch):
    import torch.distributed as dist

    model = _model()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0,
                                stage3_prefetch_bucket_size=prefetch))  # fmt: skip
    rank = dist.get_rank()
    try:
        for step in range(4):
            heads = 1
            if step == 2 and rank == 1:  # steps 0 and 1 agree: the record exists and step 1 ran unchecked
                heads = {"extra": 2, "skip": 0}[mode]
            h = rt.module["body"](torch.full((3, 6), float(step + 1)))
            for _ in range(heads):
                h = rt.module["head"](h)
            rt.backward(h.square().mean())
            rt.step()
    except RankDivergenceError as exc:
        return step, str(exc)
    return step, "no error"


def test_departure_from_record_raises_on_every_rank():
    # extra: rank 1 runs one more unit than the record; skip: rank 1 ends forward while rank 0 still gathers (with
    # no prefetch rank 0 waits in the head's all-gather until the gloo timeout, then meets rank 1's check)
    for mode, prefetch in (("extra", 10**6), ("skip", 10**6), ("skip", 1)):
        results = run_ranks(_diverge_body, 2, mode, prefetch, timeout=90, pg_timeout=4)
        for step, msg in results:
            assert step == 2, (mode, prefetch, results)
            assert "ranks gathered different parameter units" in msg, (mode, prefetch, results)
            assert "rank 0:" in msg and "rank 1:" in msg, msg
