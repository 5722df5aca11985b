"""Per-step buffers come back instead of being allocated again (stage 2/3 gradient buffers, reduce-scatter receive
buffers: zero_comm.buffers.scratch), and stage 3 keeps the units reused in backward within
``stage3_max_reuse_distance`` gathered; results still match plain PyTorch, and released units still read as
released."""

import pytest
import torch
from torch import nn

from zero_comm import CommsLogger
from zero_comm.buffers import DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY, scratch
from zero_comm.testing import run_ranks
from zero_core import ShardState, ZeroConfig, ZeroRuntime

STEPS = 4


def _make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 5 * 8).reshape(5, 8) * (step + 1)


def _reference() -> dict:
    model = _make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        model(_batch(step)).square().mean().backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_body(stage: int):
    model = _make()
    cfg = ZeroConfig(stage=stage, stage3_param_persistence_threshold=0)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    # a warm worker may have run an NVMe-offload test before, which keeps no idle buffer
    scratch.max_idle_bytes, scratch.per_key = DEFAULT_MAX_IDLE_BYTES, DEFAULT_PER_KEY
    scratch.clear()
    start = scratch.allocated
    allocated, pieces = [], []
    for step in range(STEPS):
        rt.backward(rt.module(_batch(step)).square().mean())
        rt.step()
        allocated.append(scratch.allocated - start)
        pieces.append(sum(pc.transient for pc in rt.reducer.pieces))
    return allocated, pieces, {n: v.clone() for n, v in rt.full_parameters().items()}


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_and_receive_buffers_reused_from_step_to_step(stage):
    want = _reference()
    for allocated, pieces, params in run_ranks(_train_body, 2, stage, timeout=120):
        # the first step allocates (a gradient buffer and a receive buffer per reduction at most); every later
        # step takes the same buffers back: nothing new
        assert 0 < allocated[0] <= 2 * pieces[0]
        assert allocated[1:] == [allocated[0]] * (STEPS - 1), allocated
        for name, value in want.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)


def _keep_last_body(reuse_distance: int):
    model = _make()
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=reuse_distance)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    units = [b for g in rt.flat_groups for b in g.buckets]
    linears = [m for m in model if isinstance(m, nn.Linear)]
    after_forward, readable, gathers, eval_states = [], [], [], []
    for step in range(STEPS):
        with CommsLogger() as log:
            loss = rt.module(_batch(step)).square().mean()
            after_forward.append([rt.params.state_of(b) for b in units])
            readable.append([m.weight.numel() > 0 for m in linears])
            rt.backward(loss)
            rt.step()
        gathers.append(sum(r.name == "all_gather_into_tensor" and r.dtype == "torch.float32" for r in log.records))
    with torch.no_grad():  # no backward follows: every unit is released after its forward
        rt.module(_batch(0))
    eval_states = [rt.params.state_of(b) for b in units]
    return [b.padded_numel for b in units], after_forward, readable, gathers, eval_states


# DeepSpeed's reuse rule over its trace of forward and backward: unit i's next use after its forward is its
# backward, twice the elements gathered after it away (units 272 + 68 and 68 elements after the first two; the last
# unit: 0). The default (1e9) keeps all three; 136 the last two; 1 only the last.
@pytest.mark.parametrize("distance, kept_units", [(10**9, 3), (136, 2), (135, 1), (1, 1)])
def test_units_reused_in_backward_within_the_distance_stay_gathered(distance, kept_units):
    for sizes, after_forward, readable, gathers, eval_states in run_ranks(_keep_last_body, 2, distance, timeout=120):
        n = len(sizes)
        assert sizes == [144, 272, 68]  # Linear(8,16), Linear(16,16), Linear(16,4): even, no padding on 2 ranks
        assert [2 * sum(sizes[i + 1 :]) <= distance for i in range(n)].count(True) == kept_units
        released, kept = ShardState.SHARDED, ShardState.GATHERED
        assert after_forward[0] == [released] * n  # the recording pass does not know the sequence yet
        want = [released] * (n - kept_units) + [kept] * kept_units
        assert after_forward[1:] == [want] * (STEPS - 1)
        # released units read as released (empty), the kept ones hold their values
        assert readable[1:] == [[s is kept for s in want]] * (STEPS - 1)
        # per steady step: every unit gathered for forward, and again for backward but the kept ones
        assert gathers[1:] == [2 * n - kept_units] * (STEPS - 1)
        assert eval_states == [released] * n  # no backward follows a no-grad forward: nothing kept


def test_reuse_distance_zero_keeps_nothing_gathered():
    for sizes, after_forward, readable, gathers, eval_states in run_ranks(_keep_last_body, 2, 0, timeout=120):
        n = len(sizes)
        assert eval_states == [ShardState.SHARDED] * n
        assert after_forward == [[ShardState.SHARDED] * n] * STEPS
        assert readable == [[False] * n] * STEPS
        assert gathers[1:] == [2 * n] * (STEPS - 1)
