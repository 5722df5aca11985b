"""The core's seam: ``close()`` leaves a plain module and frees everything; a master store
plugged in by keyword is called as ``zero_core.master`` documents."""

import gc
import weakref

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime, registry, zero_init
from zero_core.master_device import DeviceMaster


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))


def _hooks_left(module: nn.Module) -> list[str]:
    left = []
    for name, m in module.named_modules():
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_hooks"):
            if getattr(m, kind, None):
                left.append(f"{name or 'root'}.{kind}")
    for name, p in module.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            left.append(f"{name}._post_accumulate_grad_hooks")
    return left


def _train(rt, steps):
    import torch.distributed as dist

    for step in range(steps):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        rt.backward(nn.functional.mse_loss(rt.module(x), y))
        rt.step()


def _close_body(stage):
    model = _net()
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                     ZeroConfig(stage=stage, reduce_bucket_size=50, stage3_param_persistence_threshold=5))  # fmt: skip
    _train(rt, 2)
    x = torch.linspace(-1, 1, 12).view(2, 6)
    with torch.no_grad():
        last = rt.module(x).clone()
    trained = rt.full_parameters()
    store = rt.params if stage == 3 else None
    handles = [(registry.lookup(p), p) for p in model.parameters()]
    placed = all(h.owner is rt and h.slot.param is p and h.bucket.slots[h.slot_index] is h.slot
                 and h.bucket.group is h.group and h.group is rt.flat_groups[h.group.index] and h.store is store
                 for h, p in handles)  # fmt: skip
    del handles, store  # a handle holds its runtime strongly while kept
    ref = weakref.ref(rt)
    rt.close()
    rt.close()  # idempotent
    del rt
    gc.collect()
    with torch.no_grad():
        plain = model(x)
    own = all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.parameters())
    equal = all(torch.equal(p.detach(), trained[n]) for n, p in model.named_parameters())
    claimed = sum(registry.lookup(p) is not None for p in model.parameters())
    return torch.equal(plain, last), _hooks_left(model), ref() is None, own, equal, claimed, placed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_close_leaves_a_plain_module_and_frees_the_runtime(stage):
    for same, hooks, freed, own, equal, claimed, placed in run_ranks(_close_body, 2, stage, timeout=120):
        assert placed  # before close: each parameter's registry handle names its runtime, group, unit and slot
        assert same  # the plain module's forward equals the runtime's last forward
        assert hooks == []
        assert freed  # a weak reference to the runtime dies
        assert own  # every parameter owns its storage: no flat buffer is kept alive
        assert equal  # it holds the trained values
        assert claimed == 0


def _cycles_body(stage, cycles):
    import torch.distributed as dist

    refs = []
    counts = []
    gc.collect()
    claimed = registry.size()
    for i in range(cycles):
        with zero_init(enabled=stage == 3):
            model = _net()
        rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage))
        rt.backward(rt.module(torch.ones(2, 6)).sum())
        rt.step()
        rt.close()
        refs.append(weakref.ref(rt))
        del rt, model
        if i in (4, cycles - 1):
            gc.collect()
            counts.append(len(gc.get_objects()))
    dist.barrier()
    return sum(r() is not None for r in refs), registry.size() - claimed, counts


@pytest.mark.parametrize("stage", [2, 3])
def test_fifty_wrap_close_cycles_grow_nothing(stage):
    for alive, claimed, (after5, after50) in run_ranks(_cycles_body, 2, stage, 50, timeout=240):
        assert alive == 0 and claimed == 0
        assert after50 - after5 < 100  # no per-cycle leak (45 further cycles of ~dozens of objects each)


def _dropped_body(stage):
    refs = []
    gc.collect()
    claimed = registry.size()
    for _ in range(3):
        model = _net()
        rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                         ZeroConfig(stage=stage, stage3_param_persistence_threshold=0))  # fmt: skip
        _train(rt, 2)
        refs.append(weakref.ref(rt))
        del rt, model  # dropped without close(), as a notebook re-running its cell does
        gc.collect()
    return sum(r() is not None for r in refs), registry.size() - claimed


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_runtime_dropped_without_close_is_freed(stage):
    # the gradient hooks live on the parameters in C++, out of the garbage collector's sight: a hook holding the
    # runtime strongly kept every dropped runtime (and its buffers) alive (DeepSpeed #879's kind of leak)
    # the registry's entries hold their runtime weakly and no parameter: they go with the dropped model
    assert run_ranks(_dropped_body, 2, stage, timeout=240) == [(0, 0), (0, 0)]


class CountingMaster(DeviceMaster):
    """The default store, recording the protocol calls the runtime makes."""

    reads_ahead = True  # asks for begin_backward (as the NVMe store does)
    watches_grads = True  # asks for on_grad_ready (as the host store does)

    def __init__(self, **inputs):
        super().__init__(**inputs)
        self.calls = []

    def begin_backward(self, is_boundary):
        self.calls.append(("backward", is_boundary))

    def on_grad_ready(self, bucket, grad_shard, boundary):
        self.calls.append(("grad", bucket.index, grad_shard.numel() == bucket.chunk, boundary))

    def step(self, decision):
        shards = sorted(i for i, t in decision.grad_shards.items() if t is not None)  # the reducer's, handed in
        self.calls.append(("step", decision.overflow, round(decision.coef, 6), shards))
        return super().step(decision)

    def write_params(self, bucket, dst):
        self.calls.append(("write", bucket.index, dst.numel() == bucket.chunk))
        super().write_params(bucket, dst)


def _plugin_body(stage):
    model = _net()
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     ZeroConfig(stage=stage, reduce_bucket_size=50, stage3_param_persistence_threshold=0),
                     gradient_clipping=1e-3, master_store=CountingMaster.from_inputs)  # fmt: skip
    _train(rt, 1)
    buckets = sorted(b.index for g in rt.flat_groups if g.group_index is not None for b in g.buckets)
    trainable = [g.index for g in rt.flat_groups if g.group_index is not None]
    calls, used = rt.master.calls, isinstance(rt.master, CountingMaster)
    rt.close()
    model = _net()
    quiet = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage),
                        master_store=QuietMaster.from_inputs)  # fmt: skip
    _train(quiet, 1)
    asked = [c[0] for c in quiet.master.calls]
    quiet.close()
    return calls, buckets, used, trainable, asked


class QuietMaster(CountingMaster):
    reads_ahead = False  # its begin_backward does nothing: the runtime does not call it


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_master_store_plugin_is_called_per_bucket(stage):
    for calls, buckets, used, trainable, asked in run_ranks(_plugin_body, 2, stage, timeout=120):
        assert used and len(buckets) > 1
        grads = [c for c in calls if c[0] == "grad"]
        assert sorted(c[1] for c in grads) == buckets and all(c[2] for c in grads)
        assert calls[0][0] == "backward"  # told as backward begins, before any gradient (NVMe starts its reads)
        step = calls.index(next(c for c in calls if c[0] == "step"))
        assert all(calls.index(c) < step for c in grads)  # every gradient shard was announced before the step
        assert calls[step][1] is False and 0 < calls[step][2] < 1  # no overflow; clipped
        assert calls[step][3] == trainable  # every trainable group's gradient shard came with the decision
        writes = calls[step + 1 :]
        if stage == 3:  # fp32: each master is the stored shard itself, so the step wrote the parameters
            assert writes == []  # (params_written): the store's refresh asks for nothing
        else:  # the dense store asks for every bucket whatever the flag: its all-gather follows per bucket
            assert sorted(c[1] for c in writes) == buckets and all(c[0] == "write" and c[2] for c in writes)
        assert "backward" not in asked and "step" in asked  # reads_ahead False: begin_backward skipped


def _profile_body(stage, shared):
    from torch.profiler import ProfilerActivity, profile

    model = _net()
    extra = {"stage3_param_persistence_threshold": 0, "stage3_shared_shards": shared} if stage == 3 else {}
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=stage, **extra))
    _train(rt, 1)  # the recording pass
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train(rt, 1)
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("zero::")})


@pytest.mark.parametrize("stage,shared", [(2, None), (3, False), (3, "auto")])
def test_profiler_ranges_have_stable_names(stage, shared):
    """Issue 12 item 8: a torch profiler trace shows where a step goes, under names that do not change. Stage 3
    all-gathering waits for its gathers; reading shared windows (one host) waits for none but fences its shards."""
    want = {"zero::gather", "zero::reduce", "zero::step"}
    if stage == 3:
        want |= {"zero::release", "zero::gather_wait" if shared is False else "zero::fence"}
    for names in run_ranks(_profile_body, 2, stage, shared, timeout=120):
        assert want <= set(names), names
        assert shared is not False or "zero::fence" not in names
