"""The streams' schedule recorded on CPU (``zero_core.stream_record.RecordedStreams`` as ``ZeroRuntime(streams=...)``):
the calls ``CommContext`` makes, and for stage 3 with prefetch (one unit ahead, released after each use) and stage 2:
each unit's all-gather is issued on the gather stream before the compute kernels of the module ahead of its own and
waited for by the compute stream only where the unit is used; each reduction's result is joined from the reduce
stream (the compute stream waits for its event) before the step reads the gradient shard; the host never waits.
Training with the recorder gives exactly the parameters it gives without it."""

from contextlib import nullcontext

import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.comm_context import CommContext, StreamJoin
from zero_core.stream_record import RecordedStreams

UNIT = 8 * 8 + 8  # elements of one Linear(8, 8): one stage-3 unit


class _Done:
    def __init__(self):
        self.waited = 0

    def wait(self):
        self.waited += 1

    def ready(self):
        return True


def test_comm_context_calls_are_recorded():
    streams = RecordedStreams()
    ctx = CommContext(torch.device("cpu"), streams)
    assert ctx.active and [s.name for s in (ctx.gather_stream, ctx.reduce_stream, ctx.copy_stream)] == [
        "gather", "reduce", "copy"]  # fmt: skip
    t = torch.ones(3)
    with streams.ops():
        with ctx.on(ctx.copy_stream) as event:
            t.add_(1)
            u = torch.zeros(3).copy_(t, non_blocking=True)
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
        ctx.use(event, u)
        ctx.wait_host(event)
        handle = _Done()
        join = StreamJoin(handle, event, ctx)
        assert join.ready()
        join.wait()
    assert torch.equal(u, torch.full((3,), 2.0)) and handle.waited == 1 and ctx.done(event)
    got = [(e.kind, e.stream, e.what if e.kind != "copy" else e.what.non_blocking, e.main) for e in streams.log]
    n = event.number
    assert got == [("wait_stream", "copy", "compute", True), ("copy", "copy", True, True), ("record", "copy", n, True),
                   ("kernel", "compute", "mm.default", True), ("wait_event", "compute", n, True),
                   ("host_wait", "copy", n, True), ("wait_event", "compute", n, True)]  # fmt: skip
    assert streams.joined(1) == (2, 4)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _train(stage: int, streams: RecordedStreams | None, steps: int = 3):
    model = _mlp()
    cfg = ZeroConfig(stage=stage, overlap_comm=True, reduce_bucket_size=UNIT, stage3_param_persistence_threshold=0,
                     stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=UNIT)  # fmt: skip
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=1e-2), cfg, PrecisionPolicy.fp32(),
                     streams=streams)  # fmt: skip
    shards = set()
    if streams is not None:
        for i, m in enumerate(x for x in model if isinstance(x, nn.Linear)):
            m.register_forward_pre_hook(lambda mod, args, i=i: streams.mark(("forward", i)))
        if stage == 3:
            shards = {t.untyped_storage().data_ptr() for t in rt.params.shards if t is not None}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        if streams is not None and step == steps - 1:
            streams.log.clear()
        with streams.ops() if streams is not None else nullcontext():
            loss = rt.module(x).square().mean()
            if streams is not None:
                streams.mark("backward")
            rt.backward(loss)
            if streams is not None:
                streams.mark("step")
            rt.step()
    params = rt.full_parameters()
    if streams is None:
        return params
    log = [(e.kind, e.stream, ("gather" if e.what.src in shards else "copy") if e.kind == "copy" else e.what, e.main)
           for e in streams.log]  # fmt: skip
    joins = {i: streams.joined(i) for i, e in enumerate(streams.log) if e.stream in ("gather", "reduce")
             and e.kind in ("copy",)}  # fmt: skip
    return params, log, joins


def _body():
    return {stage: (_train(stage, RecordedStreams()), _train(stage, None)) for stage in (2, 3)}


def _at(log, kind, what=None):
    return [i for i, e in enumerate(log) if e[0] == kind and (what is None or e[2] == what)]


def test_gather_and_reduce_schedule():
    (res,) = run_ranks(_body, 1, timeout=120)
    for stage, ((params, log, joins), plain) in res.items():
        assert params.keys() == plain.keys()
        for k in params:
            torch.testing.assert_close(params[k], plain[k], rtol=0, atol=0)
        step = _at(log, "mark", "step")[0]
        assert not _at(log, "host_wait")  # nothing blocks the host
        # every reduction (a copy on the reduce stream at one rank) is joined by the compute stream before step
        reduced = [i for i in joins if log[i][1] == "reduce"]
        assert len(reduced) == 3, stage  # one per unit (stage 3) or per bucket of one layer (stage 2)
        for i in reduced:
            assert joins[i] is not None, (stage, "a reduction's event is never waited for", log[i:])
            rec, wait = joins[i]
            assert log[wait][0:2] == ("wait_event", "compute") and wait < step, (stage, log[i : wait + 1])
        if stage == 2:
            continue
        backward = _at(log, "mark", "backward")[0]
        forward = [_at(log, "mark", ("forward", i))[0] for i in range(3)]
        gathers = [i for i, e in enumerate(log) if e[0] == "copy" and e[2] == "gather"]
        assert len(gathers) == 6 and all(log[i][1] == "gather" for i in gathers)  # 3 in forward, 3 in backward
        assert gathers[0] < gathers[1] < forward[0] < gathers[2] < forward[1] < backward < gathers[3]  # one ahead
        for n, i in enumerate(gathers):
            rec, wait = joins[i]
            assert log[wait][0:2] == ("wait_event", "compute")
            ahead = sum(1 for e in log[i + 1 : wait] if e[0] == "kernel" and e[1] == "compute")
            assert (ahead == 0) if n in (0, 3) else (ahead >= 1), (n, log[i : wait + 1])
        for k in (1, 2):  # unit k is waited for once layer k-1 has run, before layer k
            assert forward[k - 1] < joins[gathers[k]][1] < forward[k]
