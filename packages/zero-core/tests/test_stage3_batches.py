"""Stage 3: units prefetched together are gathered by one all-gather (``zero_core.gather_batch``), and units
reduced together by one reduce-scatter (``GradReducer``'s batches). Parameters straddle ranks' chunks (odd sizes,
3 ranks), so a unit copied out of the rank-major output at the wrong place would show."""

import torch
from torch import nn

from zero_comm import CommsLogger
from zero_comm.testing import run_ranks
from zero_core import ShardState, ZeroConfig, ZeroRuntime
from zero_core.prefetch import GATHER_ALONE_BYTES, GATHER_BATCH_BYTES


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(7, 7) for _ in range(6)])  # 56 elements per unit: chunks of 19 at 3 ranks


def _body(extra):
    model = _model()
    want = [m.weight.detach().clone() for m in model]
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, **extra)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)  # lr 0: the weights never change
    seen = []  # each Linear's weight as its forward reads it (hooks run after the store's gather hook)
    for m in model:
        m.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    units = [b for g in rt.flat_groups for b in g.buckets]
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    states, gathers = [], []
    for _ in range(3):
        seen.clear()
        with CommsLogger() as log:
            out = rt.module(x)
            states.append([rt.params.state_of(b) for b in units])
            rt.backward(out.square().mean())
            rt.step()
        # the model's fp32 gathers (not the divergence check's integers)
        gathers.append(sum(r.name == "all_gather_into_tensor" and r.dtype == "torch.float32" for r in log.records))
    match = [torch.equal(a, b) for a, b in zip(seen, want)]
    return len(units), gathers, match, [s.value for s in states[-1]], len(rt.reducer.mode.batches)


def test_prefetched_units_are_gathered_together_and_land_in_place():
    for extra in ({}, {"stage3_max_reuse_distance": 0}):
        for n, gathers, match, after_forward, _ in run_ranks(_body, 3, extra, timeout=120):
            # every forward read its weights exactly, the steady (prefetched, batched) ones included
            assert n == 6 and match == [True] * 6, (extra, match)
            # a steady pass issues 3 all-gathers of the 6 units: the first unit, the next one alone (what the next
            # module waits for), the other 4 together
            if extra:  # reuse distance 0: released after forward, gathered the same way again for backward
                assert after_forward == [ShardState.SHARDED.value] * 6
                assert gathers[1:] == [6, 6], gathers
            else:  # DeepSpeed's default reuse distance: kept from forward to backward
                assert after_forward == [ShardState.GATHERED.value] * 6
                assert gathers[1:] == [3, 3], gathers


def _patched_body(constant, nbytes):
    """``_body({})`` with ``zero_core.prefetch``'s byte limit ``constant`` set to ``nbytes``."""
    import zero_core.prefetch as s3

    default = getattr(s3, constant)
    setattr(s3, constant, nbytes)
    try:
        return _body({})
    finally:
        setattr(s3, constant, default)  # restored: run_ranks reuses its workers


def test_a_batch_never_passes_its_byte_limit():
    assert GATHER_BATCH_BYTES == 25 * 2**20
    # 57 elements x 4 bytes per unit at 3 ranks: 2 units fit in 500 bytes, so the 4 prefetched after the next one
    # take 2 collectives; 1 byte: one unit per collective, as without batching
    for limit, want in ((500, 4), (1, 6)):
        for _, gathers, match, _, _ in run_ranks(_patched_body, 3, "GATHER_BATCH_BYTES", limit, timeout=120):
            assert match == [True] * 6 and gathers[1:] == [want, want], (limit, gathers)


def test_a_large_unit_is_gathered_alone():
    assert GATHER_ALONE_BYTES == 2 * 2**20
    # a unit gathers 19 x 3 elements x 4 bytes = 228 bytes: from a limit of 228 each one has its own collective
    # (straight into its buffer, no copy out of a batch); at 229 they batch as by default
    for limit, want in ((228, 6), (229, 3)):
        for _, gathers, match, _, _ in run_ranks(_patched_body, 3, "GATHER_ALONE_BYTES", limit, timeout=120):
            assert match == [True] * 6 and gathers[1:] == [want, want], (limit, gathers)


def test_offload_keeps_one_unit_per_collective():
    # memory first (ZeroConfig.offloads): a batch would hold up to 25 MiB more per collective in flight. The core
    # alone validates offload_optimizer and keeps its own master store, so this runs without zero_offload.
    extra = {"offload_optimizer": {"device": "cpu"}}
    for n, gathers, match, _, batches in run_ranks(_body, 3, extra, timeout=120):
        assert match == [True] * 6 and batches == 0
        assert gathers[1:] == [n, n], gathers  # the first unit, then each prefetched unit by its own all-gather
    for *_, batches in run_ranks(_body, 3, {}, timeout=120):
        assert batches == 1  # without offload: the 6 adjacent units reduced by one reduce-scatter


def _reap_body():
    import torch.distributed as dist

    from zero_comm.buffers import scratch

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])  # 72 elements per unit
    ref = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    ref.load_state_dict(model.state_dict())
    # reduce_bucket_size 150: two units per batch, six batches of one size (the pool keeps four idle per size);
    # overlap_comm off: each reduce-scatter has completed when the next batch takes its buffer
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, reduce_bucket_size=150, overlap_comm=False)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    allocated = []
    for step in range(4):
        xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]
        rt.backward(rt.module(xs[rank]).square().mean())
        rt.step()
        allocated.append(scratch.allocated)
        opt.zero_grad()
        (sum(ref(x).square().mean() for x in xs) / world).backward()  # the ranks' average gradient
        opt.step()
    full = rt.full_parameters()
    err = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
    return len(rt.reducer.mode.batches), allocated, err


def test_a_batch_buffer_goes_back_when_its_reduction_completes():
    for batches, allocated, err in run_ranks(_reap_body, 2, timeout=120):
        assert batches == 6
        # steady steps allocate no gradient buffer: each batch reuses the one the batch before it gave back
        # (held to the end of backward, they overflowed the pool: three allocated per step, measured)
        assert allocated[1:] == [allocated[1]] * 3, allocated
        assert err < 1e-6, err
