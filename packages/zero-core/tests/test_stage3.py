"""Stage-3 internals: unit states around forward/backward, all-gathers O(units), prefetch trace."""

import pytest
import torch
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import ShardState, ZeroConfig, ZeroRuntime


def _body(prefetch):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(5)])
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=prefetch,
                                stage3_max_reuse_distance=1))  # fmt: skip  # keeps the last unit only (1e9: all)
    units = [b for g in rt.flat_groups for b in g.buckets]
    ahead = []  # state of unit 2 when module 1 starts: prefetched or not
    model[1].register_forward_pre_hook(lambda m, a: ahead.append(rt.params.state_of(units[2])))
    states, counts = [], []
    for _ in range(3):
        with CommsLogger() as log:
            out = rt.module(torch.ones(4, 10))
            states.append([rt.params.state_of(b) for b in units])
            rt.backward(out.square().mean())
            states.append([rt.params.state_of(b) for b in units])
            rt.step()
        counts.append((log.count("all_gather_into_tensor"), log.count("reduce_scatter_tensor"), log.count()))
    return len(units), states, counts, [b.index for b in rt.params.prefetch.order], ahead


@pytest.mark.smoke
def test_units_released_and_collectives_per_step_scale_with_units():
    for prefetch in (1, 10**6):
        n, states, counts, recorded, ahead = run_ranks(_body, 2, prefetch, timeout=60)[0]
        assert n == 5
        after_forward, after_backward = states[0::2], states[1::2]
        assert all(s == ShardState.SHARDED for step in after_backward for s in step)
        # the recording pass releases every unit after its forward; once the order is recorded, the forward's
        # last unit stays gathered for backward, which needs it first (not released and gathered again)
        assert all(s == ShardState.SHARDED for s in after_forward[0])
        for step in after_forward[1:]:
            assert step[:-1] == [ShardState.SHARDED] * (n - 1) and step[-1] == ShardState.GATHERED, step
        # per step: one reduce-scatter for all 5 units (adjacent, far under reduce_bucket_size), one norm
        # all-reduce, one forward-order check; only the recording step checks each gather first (divergence). Without
        # prefetch each unit is gathered for forward and again for backward (but the last). With it, the units one
        # prefetch issues share a collective (the one after the current unit alone): the recording step's
        # backward gathers its 4 prefetched units in 2; a steady step, forward 1 + 1 + 1 (3 units), backward 2.
        if prefetch == 1:
            first, steady = (4 * n + 1, 1, 4 * n + 3), (2 * n, 1, 2 * n + 2)
        else:
            first, steady = (4 * n - 1, 1, 4 * n + 1), (5 + 1, 1, 5 + 3)
        assert counts == [first, steady, steady]
        assert recorded == list(range(n))  # forward order recorded on the first pass
        # first pass records; later passes prefetch along the record when the budget allows
        want = ShardState.SHARDED if prefetch == 1 else ShardState.GATHERING
        assert ahead[0] == ShardState.SHARDED and ahead[1:] == [want, want], ahead


def _raising_first_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=3, stage3_param_persistence_threshold=0))  # fmt: skip
    boom = model[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("user error mid-forward")))
    modes = []
    try:
        rt.module(torch.ones(3, 6))
    except RuntimeError as e:
        assert "user error mid-forward" in str(e)
    modes.append(torch._C._len_torch_function_stack())  # the first pass's released-read check must be gone
    boom.remove()
    rt.backward(rt.module(torch.ones(3, 6)).square().mean())
    rt.step()
    rt.close()
    modes.append(torch._C._len_torch_function_stack())
    return modes


def test_forward_that_raises_leaves_no_check_mode_behind():
    # a first forward that raised once left stage 3's TorchFunctionMode entered for the rest of the process, so a
    # later unrelated program (here: a reused test worker compiling a model) ran under it
    for modes in run_ranks(_raising_first_forward, 2, timeout=120):
        assert modes == [0, 0]
