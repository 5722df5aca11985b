"""The profile-guided loop on 2 gloo ranks: warm-up then plan; selective unsharding cuts all-gathers per optimizer
step >= 2x at accumulation 4 (counted with zero_comm's CommsLogger); prefetch moves gathers and stays within its
budget (measured by the profiling interpreter); no graph compiles after the warm-up switch; gradients unchanged."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_compile import CompiledZero
from zero_compile.testing import LocalShards, TinyTransformer, batches

STEPS, ACC = 4, 4


def _train(unshard: bool, prefetch: bool, budget: int | None, measure: bool = False):
    torch._dynamo.reset()  # warm test workers are reused across tests: no graph of an earlier test
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = TinyTransformer()
    src = LocalShards(model, dist.group.WORLD)
    cz = CompiledZero(model, src, dist.group.WORLD, stage=3, warmup_steps=2, unshard=unshard, prefetch=prefetch,
                      budget_bytes=budget, measure=measure)  # fmt: skip
    data = batches(STEPS, ACC, world)
    gathers, peaks = [], []
    for step in range(STEPS):
        cz.store.reset_peak()
        with CommsLogger() as log:
            for micro in range(ACC):
                ids, tgt = data[step][micro][rank]
                (cz(ids, tgt) / ACC).backward()
                cz.after_backward()
        gathers.append(log.count("all_gather_into_tensor"))
        peaks.append(max((p.peak_gathered_bytes for p in cz.store.profiles), default=0))
        cz.store.profiles.clear()
        cz.after_step()
    grads = {f"{u}.{n}": g.clone() for (u, n), g in src.full_grads().items()}
    moved = sum(n.get("prefetch", {}).get("moved", 0) for n in cz.notes)
    fused = sum(n.get("prefetch", {}).get("fused", 0) for n in cz.notes)
    unit_bytes = [cz.store.unit_bytes(u) for u in range(len(src.layout.units))]
    out = dict(gathers=gathers, peaks=peaks, compiles=[c[0] for c in cz.compiles], grads=grads, moved=moved,
               fused=fused, keep=sorted(cz.plan.keep) if cz.plan else [], unit_bytes=unit_bytes)  # fmt: skip
    cz.close()
    return out


def _both():
    return _train(False, False, None), _train(True, False, None)


def test_selective_unsharding_cuts_gathers_per_step_at_accumulation_4():
    for base, kept in run_ranks(_both, 2, timeout=300):
        # warm-up steps (0, 1) gather every unit in every forward and backward; afterwards all units are kept
        assert base["gathers"][2] == base["gathers"][0] > 0
        assert kept["gathers"][2] * 2 <= base["gathers"][2]
        assert kept["gathers"][3] == kept["gathers"][2]
        assert kept["keep"] == list(range(len(kept["unit_bytes"])))
        # graphs compile at step 0 (warm-up) and once more at step 2 (the planned passes), never per step after
        assert set(kept["compiles"]) == {0, 2} and set(base["compiles"]) == {0}
        for k, g in base["grads"].items():
            torch.testing.assert_close(kept["grads"][k], g, rtol=1e-6, atol=1e-7)


def _prefetch_budget():
    probe = _train(False, False, None)
    sizes = sorted(probe["unit_bytes"])
    budget = sizes[-1] + sizes[-2]  # room for the largest unit and one more in flight
    return budget, _train(False, True, budget, measure=True), probe


def test_prefetch_moves_gathers_within_budget_and_keeps_gradients():
    for budget, run, probe in run_ranks(_prefetch_budget, 2, timeout=300):
        assert run["moved"] > 0
        assert 0 < max(run["peaks"][2:]) <= budget
        assert run["gathers"][2] <= probe["gathers"][2]  # fused small gathers can only lower the count
        for k, g in probe["grads"].items():
            torch.testing.assert_close(run["grads"][k], g, rtol=1e-6, atol=1e-7)
