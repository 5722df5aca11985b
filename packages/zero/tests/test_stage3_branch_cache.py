"""Stage 3 with a module taken on some steps only, and DeepSpeed's cache control ``empty_partition_cache()``:
parameters equal the single-process run after every step, and after the call nothing is left gathered, kept for
reuse or in flight (prefetch state forgotten, the order recorded again)."""

import pytest
import torch

import zero
from zero_comm.testing import run_ranks
from zero_core.stage3 import ShardState

BRANCH = [True, True, False, True, False, False]


class Branchy(torch.nn.Module):
    """``fc1 -> SELU -> [fc2 when use_fc2] -> SELU -> fc3 -> sigmoid``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(6, 12), torch.nn.Linear(12, 12), torch.nn.Linear(12, 1)

    def forward(self, x, use_fc2):
        h = torch.nn.functional.selu(self.fc1(x))
        if use_fc2:
            h = self.fc2(h)
        return torch.sigmoid(self.fc3(torch.nn.functional.selu(h)))


def _data(step, rank):
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randint(0, 2, (4, 1), generator=g).float()


def _cfg(prefetch=1e6, reuse=None):
    zo = {"stage": 3, "stage3_prefetch_bucket_size": prefetch, "stage3_param_persistence_threshold": 0}
    if reuse is not None:
        zo["stage3_max_reuse_distance"] = reuse
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": zo}  # fmt: skip


def _held(store):
    """Units not released, units kept for reuse, gathers in flight."""
    gathered = [b.index for g in store.flat_groups for b in g.buckets if store.state_of(b) is not ShardState.SHARDED]
    return gathered, sum(u.kept for u in store.units.buffers), sum(u.inflight is not None for u in store.units.buffers)


def branch_body(empty, reuse):
    model = Branchy()
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 config=_cfg(reuse=reuse))  # fmt: skip
    rank, after, held = torch.distributed.get_rank(), [], []
    for step, use_fc2 in enumerate(BRANCH):
        x, y = _data(step, rank)
        engine.backward(torch.nn.functional.binary_cross_entropy(engine(x, use_fc2), y))
        engine.step()
        if empty:
            with torch.no_grad():  # an evaluation forward without the branch: what was prefetched for it stays
                engine(x, False)
            before = _held(engine.runtime.params)
            engine.empty_partition_cache()
            held.append((before, _held(engine.runtime.params)))
        after.append(engine.runtime.full_parameters())
    engine.destroy()
    return after, held


def _reference():
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step, use_fc2 in enumerate(BRANCH):
        opt.zero_grad(set_to_none=True)
        losses = [torch.nn.functional.binary_cross_entropy(model(x, use_fc2), y) for x, y in
                  (_data(step, 0), _data(step, 1))]  # fmt: skip
        (sum(losses) / 2).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return out


@pytest.mark.parametrize(("empty", "reuse"), [(True, None), (False, None), (True, 0)])
def test_branch_on_some_steps_equals_one_process(empty, reuse):
    ref = _reference()
    for after, held in run_ranks(branch_body, 2, empty, reuse, timeout=120, threads=1):
        for step, (got, want) in enumerate(zip(after, ref)):
            for name, value in want.items():
                torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
        if empty:
            assert any(before[0] for before, _ in held)  # the evaluation forward left prefetched units gathered
            assert [after for _, after in held] == [([], 0, 0)] * len(BRANCH)  # nothing gathered, kept, in flight
