"""zero-comm benchmark: bytes on the wire (bf16 vs qwZ int8, bf16 vs qgZ int4, vs theory), wrapper overhead, and
the gloo algorithms of all-gather / reduce-scatter (native vs broadcast / all_to_all / shm, and what "auto" picks).

Runs 2 gloo ranks on this machine (zero_comm.testing.run_ranks). Bytes come from CommsLogger, which accounts what
each rank sends for the algorithm the backend uses. Overhead: zero_comm wrappers vs the raw torch.distributed call,
interleaved in one run, medians (this machine is shared and noisy).

Usage: python benchmarks/bench_comm.py [--quick]; ``main(argv) -> str`` returns the markdown.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from zero_comm import (
    CommsLogger,
    QuantizedAllGather,
    QuantizedReduceScatter,
    all_gather_into_tensor,
    all_reduce,
    reduce_scatter_tensor,
)
from zero_comm.quantize import DEFAULT_BLOCK, payload_bytes
from zero_comm.testing import run_ranks

WORLD = 2


def _wire(log: CommsLogger) -> int:
    return sum(r.wire_bytes for r in log.records)


def _bytes_body(numel: int) -> dict:
    group, world = dist.group.WORLD, dist.get_world_size()
    k = numel // world
    shard = torch.randn(k)
    out = {}
    with CommsLogger() as log:
        all_gather_into_tensor(torch.empty(world * k, dtype=torch.bfloat16), shard.bfloat16(), group)
    out["ag_bf16"] = _wire(log)
    with CommsLogger() as log:
        QuantizedAllGather(group, bits=8)(torch.empty(world * k, dtype=torch.bfloat16), shard.bfloat16())
    out["ag_qwz8"] = _wire(log)
    grad = torch.randn(world * k)
    with CommsLogger() as log:
        reduce_scatter_tensor(torch.empty(k, dtype=torch.bfloat16), grad.bfloat16(), group, algorithm="native")
    out["rs_bf16"] = _wire(log)
    with CommsLogger() as log:
        reduce_scatter_tensor(torch.empty(k, dtype=torch.bfloat16), grad.bfloat16(), group)
    out["rs_bf16_auto"] = _wire(log)
    with CommsLogger() as log:
        QuantizedReduceScatter(group, bits=4)(torch.empty(k), grad)
    out["rs_qgz4"] = _wire(log)
    return out


BLOCK_CALLS = 10  # calls per timed sample: amortises the skew between ranks leaving the barrier


def _time_pair(raw, ours, iters: int) -> tuple[float, float]:
    """Interleave blocks of raw and wrapped calls (a barrier before each block); median seconds per call."""
    group = dist.group.WORLD
    t_raw, t_ours = [], []
    for i in range(iters):
        for fn, acc in ((raw, t_raw), (ours, t_ours)) if i % 2 else ((ours, t_ours), (raw, t_raw)):
            dist.barrier(group)
            start = time.perf_counter()
            for _ in range(BLOCK_CALLS):
                fn()
            acc.append((time.perf_counter() - start) / BLOCK_CALLS)
    return statistics.median(t_raw), statistics.median(t_ours)


def _overhead_body(numel: int, iters: int) -> dict:
    group, world = dist.group.WORLD, dist.get_world_size()
    k = numel // world
    inp, out = torch.randn(k).bfloat16(), torch.empty(world * k, dtype=torch.bfloat16)
    big, small = torch.randn(world * k).bfloat16(), torch.empty(k, dtype=torch.bfloat16)
    t = torch.randn(numel)
    raw_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    raw_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    res = {}
    for _ in range(5):  # warm-up both paths
        raw_ag(out, inp, group=group)
        all_gather_into_tensor(out, inp, group, algorithm="native")
    # algorithm="native": the same torch call on both sides, so the difference is the wrapper's own cost
    res["all_gather bf16"] = _time_pair(
        lambda: raw_ag(out, inp, group=group),
        lambda: all_gather_into_tensor(out, inp, group, algorithm="native"),
        iters,
    )
    res["reduce_scatter bf16"] = _time_pair(
        lambda: raw_rs(small, big, group=group),
        lambda: reduce_scatter_tensor(small, big, group, algorithm="native"),
        iters,
    )
    res["all_reduce fp32"] = _time_pair(lambda: dist.all_reduce(t, group=group), lambda: all_reduce(t, group), iters)
    return res


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark on 2 gloo ranks and return a markdown report (two tables)."""
    argv = sys.argv[1:] if argv is None else argv
    quick = "--quick" in argv
    numel = 1 << 22  # 4M elements: an 8 MB bf16 tensor
    n = WORLD
    b = run_ranks(_bytes_body, n, numel, timeout=300)[0]
    k = numel // n
    ring = (n - 1) / n
    lines = [
        f"### Bytes on the wire per rank ({n} gloo ranks, {numel} elements, quantization block {DEFAULT_BLOCK})",
        "",
        "| collective | measured bytes sent/rank | theory | ratio to bf16 ring |",
        "|---|---|---|---|",
    ]
    bf16_ring = ring * numel * 2
    rows = [
        ("all-gather bf16", b["ag_bf16"], bf16_ring),
        ("qwZ all-gather int8 (+fp32 scales)", b["ag_qwz8"], ring * n * payload_bytes(k, 8, DEFAULT_BLOCK)),
        ("reduce-scatter bf16, gloo native (all-reduce)", b["rs_bf16"], 2 * ring * numel * 2),
        ("reduce-scatter bf16, auto (all_to_all)", b["rs_bf16_auto"], bf16_ring),
        ("reduce-scatter bf16, ring theory (NCCL)", bf16_ring, bf16_ring),
        ("qgZ reduce-scatter int4 (+fp32 scales)", b["rs_qgz4"], ring * n * payload_bytes(k, 4, DEFAULT_BLOCK)),
    ]
    for label, measured, theory in rows:
        lines.append(f"| {label} | {measured:,.0f} | {theory:,.0f} | {measured / bf16_ring:.3f} |")
    lines += [
        "",
        f"qgZ int4 / bf16 reduce-scatter: {b['rs_qgz4'] / bf16_ring:.3f} of the ring bf16 bytes "
        f"(goal <= 0.3), {b['rs_qgz4'] / b['rs_bf16']:.3f} of what gloo's bf16 reduce-scatter really sends.",
        "",
    ]
    iters = 10 if quick else 40
    table = [
        f"### Wrapper overhead vs raw torch.distributed ({n} gloo ranks, "
        f"median of {iters} interleaved blocks of {BLOCK_CALLS} calls)",
        "",
        "| collective | elements | raw ms | zero_comm ms | overhead |",
        "|---|---|---|---|---|",
    ]
    for size in (1 << 10, 1 << 20):
        o = run_ranks(_overhead_body, n, size, iters, timeout=600)[0]
        for name, (raw, ours) in o.items():
            table.append(f"| {name} | {size} | {raw * 1e3:.3f} | {ours * 1e3:.3f} | {(ours / raw - 1) * 100:+.1f}% |")
    return "\n".join(lines + table + [""] + _algorithms_table(quick)) + "\n"


ALG_CASES = [("all_gather", a) for a in ("native", "broadcast", "all_to_all", "shm", "auto")] + [
    ("reduce_scatter", a) for a in ("native", "all_to_all", "shm", "auto")
]


def _algorithms_body(full_numel: int, iters: int) -> dict:
    """Median ms per call of every (collective, algorithm) on an fp32 full buffer; interleaved, barrier per call."""
    group, world = dist.group.WORLD, dist.get_world_size()
    k = full_numel // world
    shard, out = torch.randn(k), torch.empty(world * k)
    full, part = torch.randn(world * k), torch.empty(k)
    calls = {}
    for coll, alg in ALG_CASES:
        if coll == "all_gather":
            calls[coll, alg] = lambda a=alg: all_gather_into_tensor(out, shard, group, algorithm=a)
        else:
            calls[coll, alg] = lambda a=alg: reduce_scatter_tensor(part, full, group, algorithm=a)
    times = {key: [] for key in calls}
    for fn in calls.values():
        fn()  # warm-up
    order = list(calls)
    for i in range(iters):
        for key in order if i % 2 else order[::-1]:
            dist.barrier(group)
            start = time.perf_counter()
            calls[key]()
            times[key].append(time.perf_counter() - start)
    with CommsLogger() as log:
        calls["all_gather", "auto"]()
        calls["reduce_scatter", "auto"]()
    chosen = {r.name.split("_into")[0].replace("_tensor", ""): r.algorithm for r in log.records}
    return {"ms": {key: statistics.median(v) * 1e3 for key, v in times.items()}, "auto": chosen}


def _algorithms_table(quick: bool) -> list[str]:
    iters = 5 if quick else 9
    lines = [
        f"### gloo algorithms ({WORLD} gloo ranks, fp32, median of {iters} interleaved calls; ms; ratio = native / "
        "algorithm, > 1 is faster than native)",
        "",
        "| collective | full buffer | native ms | broadcast ms | all_to_all ms | shm ms | auto ms | auto picks "
        "| native/broadcast | native/all_to_all | native/shm | native/auto |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mib in (1, 32):
        res = run_ranks(_algorithms_body, WORLD, mib << 18, iters, timeout=300)[0]
        ms = res["ms"]
        for coll in ("all_gather", "reduce_scatter"):
            nat = ms[coll, "native"]
            cell = {a: ms.get((coll, a)) for a in ("broadcast", "all_to_all", "shm", "auto")}
            fmt = {a: (f"{v:.2f}", f"{nat / v:.2f}x") if v else ("-", "-") for a, v in cell.items()}
            lines.append(
                f"| {coll} | {mib} MiB | {nat:.2f} | {fmt['broadcast'][0]} | {fmt['all_to_all'][0]} | {fmt['shm'][0]} "
                f"| {fmt['auto'][0]} | {res['auto'][coll]} | {fmt['broadcast'][1]} | {fmt['all_to_all'][1]} "
                f"| {fmt['shm'][1]} | {fmt['auto'][1]} |"
            )
    return lines


if __name__ == "__main__":
    print(main())
