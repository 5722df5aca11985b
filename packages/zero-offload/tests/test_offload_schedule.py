"""The offload schedule, recorded on CPU (``zero_core.stream_record``): which copy is issued on which stream, before
which kernel, and where anything waits; what a GPU would overlap follows from it.

* Parameter offload at stage 3 with prefetch (one unit ahead): each unit's host-to-device copy is issued on the
  gather stream, asked not to block, before the compute "kernels" (matrix multiplies) of the module ahead of its own;
  the compute stream waits for the copy's event only where the unit is used, and the host never waits.
* ZeRO-Offload and SuperOffload at stage 2: each reduced gradient piece lands on the copy stream right after its
  reduction (ordered after that reduction alone, not after the compute stream) and is copied to host memory there
  while backward still has kernels to issue; the training thread never waits during backward; SuperOffload submits
  its speculative sub-group steps during backward (its worker waits for the copies), ZeRO-Offload steps at
  ``step()``.

Each recorded run trains to the same parameters as the same run without the recorder.
"""

import functools

import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.reducer import GradReducer
from zero_core.stream_record import RecordedStreams
from zero_offload import OffloadMaster, OffloadParamStore

UNIT = 8 * 8 + 8  # elements of one Linear(8, 8): a stage-3 unit, a reduction piece
STEPS = 3


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))


def _runtime(mode: str, streams: RecordedStreams | None) -> ZeroRuntime:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "param":  # one unit prefetched ahead, released after each use (backward gathers again)
        cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0,
                         stage3_prefetch_bucket_size=UNIT)  # fmt: skip
        return ZeroRuntime(model, opt, cfg, PrecisionPolicy.fp32(), streams=streams, param_store=OffloadParamStore())
    # one bucket reduced in three pieces of one layer each (at one rank too: the master store watches gradients)
    return ZeroRuntime(model, opt, ZeroConfig(stage=2, overlap_comm=True), PrecisionPolicy.fp32(), streams=streams,
                       master_store=OffloadMaster.builder("cpu", super_offload=mode == "super", sub_group_size=16),
                       grad_reduction=functools.partial(GradReducer.from_inputs, piece_bytes=UNIT * 4))  # fmt: skip


def _train(rt, streams: RecordedStreams | None, steps: int = STEPS):
    """``steps`` steps on fixed data; the last one recorded (log cleared first), with marks for each layer's forward,
    the start of backward and of step."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        last = streams is not None and step == steps - 1
        if last:
            streams.log.clear()
            ctx = streams.ops()
            ctx.__enter__()
        loss = rt.module(x).square().mean()
        if last:
            streams.mark("backward")
        rt.backward(loss, is_boundary=True)
        if last:
            streams.mark("step")
        rt.step()
        if last:
            ctx.__exit__(None, None, None)
    return {k: v.clone() for k, v in rt.full_parameters().items()}


def _label(streams: RecordedStreams, h2d: set[int], d2h: set[int]) -> list[tuple]:
    """The log as plain tuples: copies named "h2d" (from a host shard), "d2h" (into the host gradient) or "copy"."""
    out = []
    for e in streams.log:
        what = e.what
        if e.kind == "copy":
            what = ("h2d" if what.src in h2d else "d2h" if what.dst in d2h else "copy", what.non_blocking)
        out.append((e.kind, e.stream, what, e.main))
    return out


def _body():
    out = {}
    for mode in ("param", "cpu", "super"):
        streams = RecordedStreams()
        rt = _runtime(mode, streams)
        h2d, d2h = set(), set()
        if mode == "param":
            h2d = {t.untyped_storage().data_ptr() for t in rt.params.offloaded_chunks().host.values()}
            layers = [m for m in rt.module if isinstance(m, nn.Linear)]
            for i, m in enumerate(layers):  # after the store's own pre-forward hook: its gathers come first
                m.register_forward_pre_hook(lambda mod, args, i=i, s=streams: s.mark(("forward", i)))
        else:
            d2h = {rt.master.store.grad_view(0).untyped_storage().data_ptr()}
            spec = rt.master.spec
            if spec is not None:
                submit = spec.on_ready

                def on_ready(sub_groups, submit=submit, streams=streams):
                    streams.mark(("speculate", len(sub_groups)))
                    submit(sub_groups)

                spec.on_ready = on_ready
        params = _train(rt, streams)
        joins = {i: streams.joined(i) for i, e in enumerate(streams.log) if e.kind == "copy" and e.stream != "compute"}
        out[mode] = (_label(streams, h2d, d2h), joins, params, _train(_runtime(mode, None), None))
    return out


def _where(log, kind, what=None):
    return [i for i, e in enumerate(log) if e[0] == kind and (what is None or e[2] == what)]


def _kernels_between(log, lo, hi):
    return sum(1 for e in log[lo + 1 : hi] if e[0] == "kernel" and e[1] == "compute")


def test_offload_schedules_on_cpu():
    (res,) = run_ranks(_body, 1, timeout=120)
    for mode, (_, _, params, plain) in res.items():
        assert params.keys() == plain.keys()
        for k in params:  # the recorder changes nothing that is computed
            torch.testing.assert_close(params[k], plain[k], rtol=0, atol=0, msg=lambda m, k=k, w=mode: f"{w} {k}: {m}")

    # -- parameter offload: copies on the gather stream, one unit ahead, waited for where used
    log, joins, _, _ = res["param"]
    backward, step = _where(log, "mark", "backward")[0], _where(log, "mark", "step")[0]
    forward = [_where(log, "mark", ("forward", i))[0] for i in range(3)]
    copies = [i for i, e in enumerate(log) if e[0] == "copy" and e[2][0] == "h2d"]
    fwd, bwd = [i for i in copies if i < backward], [i for i in copies if backward < i < step]
    assert len(fwd) == 3 and len(bwd) == 3  # a unit's chunk copied at each of its gathers (released after each use)
    for i in copies:
        assert log[i][1] == "gather" and log[i][2][1] is True, log[i]  # off the compute stream, never blocking
    # unit k+1's copy is issued after layer k-1's forward began and before layer k's: one unit ahead
    assert fwd[0] < forward[0] and fwd[1] < forward[0] and forward[0] < fwd[2] < forward[1]
    for n, i in enumerate(copies):
        rec, wait = joins[i]
        assert log[wait][0] == "wait_event" and log[wait][1] == "compute"  # a stream wait, not the host
        ahead = _kernels_between(log, i, wait)
        # the first gather of each pass is waited for at once; every prefetched one has compute issued behind it
        assert (ahead == 0) if n in (0, 3) else (ahead >= 1), (n, log[i : wait + 1])
    for k in (1, 2):  # the compute stream waits for unit k only once layer k-1 has run
        assert forward[k - 1] < joins[fwd[k]][1] < forward[k]
    assert all(i > step for i in _where(log, "host_wait"))  # the host never waits in forward or backward

    # -- ZeRO-Offload / SuperOffload: gradients to the host on the copy stream while backward runs
    for mode in ("cpu", "super"):
        log, joins, _, _ = res[mode]
        backward, step = _where(log, "mark", "backward")[0], _where(log, "mark", "step")[0]
        last_kernel = max(i for i in _where(log, "kernel") if i < step)
        copies = [i for i, e in enumerate(log) if e[0] == "copy" and e[2][0] == "d2h"]
        assert len(copies) == 15, (mode, len(copies))  # 3 pieces x 5 sub-groups (16-element ones, then a bias)
        for i in copies:
            assert log[i][1] == "copy" and log[i][2][1] is True, (mode, log[i])
            # the copy stream waited for the piece's reduction (its event on the reduce stream) and for nothing on
            # the compute stream: the landing and the copy queue there behind that reduction alone
            reduced = [j for j in _where(log, "record") if log[j][1] == "reduce" and j < i]
            assert reduced, (mode, "no reduction before the copy")
            r = reduced[-1]
            assert any(log[j][0:3] == ("wait_event", "copy", log[r][2]) for j in range(r, i)), (mode, log[r : i + 1])
            assert not any(log[j][0:3] == ("wait_stream", "copy", "compute") for j in range(r, i)), (mode, log[r:i])
        assert sum(i < last_kernel for i in copies) == 10, mode  # two of the three pieces land during backward
        main_waits = [i for i in _where(log, "host_wait") if log[i][3]]
        assert all(i > step for i in main_waits), (mode, main_waits)  # the training thread never waits in backward
        if mode == "cpu":  # ZeRO-Offload steps at step(): it waits there for the copies
            assert main_waits and all(log[i][1] == "copy" for i in main_waits)
        else:  # SuperOffload: sub-groups submitted as their gradients land, the worker waits for their copies
            submits = [i for i in _where(log, "mark") if log[i][2][0] == "speculate" and log[i][2][1]]
            assert len(submits) == 3 and sum(i < last_kernel for i in submits) == 2
            assert sum(1 for e in log if e[0] == "host_wait" and not e[3]) == 15
