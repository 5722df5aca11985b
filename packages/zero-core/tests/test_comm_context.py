"""The comm context's CPU path: no streams, every method a no-op. The CUDA path (gathers and reductions on their
own streams, overlapping compute) is checked on a GPU machine by gpu/streams.py (`nox -s gpu`)."""

import torch

from zero_core.comm_context import CommContext


def test_cpu_context_is_a_no_op():
    for device in (torch.device("cpu"), torch.device("cuda")):  # no CUDA here: inactive either way
        ctx = CommContext(device)
        assert not ctx.active and ctx.gather_stream is None and ctx.reduce_stream is None
        t = torch.ones(3)
        with ctx.on(ctx.gather_stream) as event:
            t.add_(1)  # the body runs, in place, on the one thread
        assert event is None and torch.equal(t, torch.full((3,), 2.0))
        ctx.use(event, t)  # nothing to wait for
        ctx.use(None)
