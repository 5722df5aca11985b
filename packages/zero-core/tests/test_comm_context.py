"""The comm context's CPU path (no streams, every method a no-op) and the GPU check's CPU behaviour: it exits 0
saying "no CUDA", and its trace analysis (which stream the all-gathers ran on, how much of them overlapped compute)
is right on a hand-made trace. The CUDA path itself runs in packages/zero-core/gpu_check.py on a GPU machine."""

import importlib.util
import json
import pathlib

import torch

from zero_core.comm_context import CommContext

CHECK = pathlib.Path(__file__).resolve().parents[1] / "gpu_check.py"


def _gpu_check():
    spec = importlib.util.spec_from_file_location("zero_core_gpu_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_gpu_check_without_cuda_says_so(capsys):
    assert _gpu_check().main() == 0
    assert "no CUDA" in capsys.readouterr().out


def _kernel(name, stream, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_gpu_check_trace_analysis(tmp_path):
    mod = _gpu_check()
    trace = tmp_path / "t.json"
    events = [_kernel("ampere_sgemm", 7, 0, 100), _kernel("ampere_sgemm", 7, 150, 100),
              _kernel("ncclDevKernel_AllGather_RING_LL", 20, 50, 100),  # half over the first gemm, half idle
              _kernel("ncclDevKernel_ReduceScatter", 21, 300, 10), {"ph": "i", "name": "marker"}]  # fmt: skip
    trace.write_text(json.dumps({"traceEvents": events}))
    got = mod._streams(str(trace))
    assert got == {"gather_streams": [20], "compute_streams": [7], "gather_us": 100, "overlap_us": 50}
    # one rank: NCCL copies instead of launching kernels; the copies off the compute stream count as gathers
    events = [_kernel("ampere_sgemm", 7, 0, 100), _kernel("Memcpy DtoD", 20, 90, 20, cat="gpu_memcpy")]
    trace.write_text(json.dumps({"traceEvents": events}))
    got = mod._streams(str(trace))
    assert got["gather_streams"] == [20] and got["gather_us"] == 20 and got["overlap_us"] == 10
