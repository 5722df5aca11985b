"""Algorithm choice for all-gather and reduce-scatter: gloo's own calls are 2-3.5x slower than the same bytes cost.

gloo (torch 2.x) runs ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` far below what its all-to-all and
broadcast reach on the same bytes, so on gloo :func:`zero_comm.all_gather_into_tensor` and
:func:`zero_comm.reduce_scatter_tensor` can run them as:

* all-gather ``"broadcast"``: each rank copies its shard into its slot of the output, then ``w`` broadcasts (rank i
  broadcasts slot i), all issued async and waited together. gloo's broadcast is a binomial tree rooted at ``src``
  (``gloo/broadcast.cc``: ranks renumbered relative to the root, ``log2ceil(w)`` rounds), so one broadcast of ``k``
  elements sends ``(w-1) k`` in all and its root sends ``ceil(log2 w) k``; over the ``w`` broadcasts every rank takes
  every tree position once, so each rank sends exactly ``(w-1) k = (w-1)/w`` of the output, like a ring.
* all-gather ``"all_to_all"``: the shard repeated ``w`` times (one copy) through ``all_to_all_single``; each rank
  sends ``(w-1)/w`` of the output.
* reduce-scatter ``"all_to_all"``: ``all_to_all_single`` hands rank r chunk r of every rank's input; ``wait`` sums
  the ``w`` received chunks in rank order 0..w-1 (fixed order: the same inputs give bitwise the same output on
  every run). Each rank sends ``(w-1)/w`` of the input, half what gloo's native call (an all-reduce) sends.
  fp32/fp64/integers sum in their own dtype (at ``w = 2`` bitwise equal to gloo's ``a + b``); bf16/fp16 sum in fp32
  and round once at the end, so the result is at least as accurate as gloo's, which rounds after every addition.

``"auto"`` (the default) picks per backend and size from these measurements of the raw torch.distributed calls
(torch 2.13, gloo, 1 thread per rank, medians of 7-9 interleaved runs on a shared 2-core machine; ms, fp32, size =
the full buffer; "RS via AR" = all-reduce of a copy plus a slice, measured but not offered as it never beats
"all_to_all" by a margin; 3-rank rows, omitted, rank the same way). ``benchmarks/bench_comm.py`` ("gloo
algorithms") re-measures the 2-rank case through these wrappers:

==========  =====  ======  ===========  ============  ======  ======  ==========
full size   ranks  AG nat  AG bcast     AG a2a        RS nat  RS a2a  RS via AR
==========  =====  ======  ===========  ============  ======  ======  ==========
64 KiB      2      0.27    0.30         0.40          0.44    0.20    0.35
1 MiB       2      1.12    3.68         3.15          1.86    0.92    1.71
2 MiB       2      2.06    1.59         1.73          2.95    1.74    3.41
8 MiB       2      7.7     4.7          11.2          15.6    7.2     17.1
64 MiB      2      91.7    41.5         84.6          137     55.2    139
64 KiB      4      1.66    4.71         1.38          5.13    4.01    6.38
1 MiB       4      4.78    3.21         2.00          5.86    3.81    3.43
2 MiB       4      5.92    5.35         4.43          10.3    3.91    7.17
8 MiB       4      22.1    12.6         18.5          44.3    16.7    46.5
64 MiB      4      234     86.5         235           343     126     284
==========  =====  ======  ===========  ============  ======  ======  ==========

So on gloo: all-gather uses ``"broadcast"`` from :data:`GLOO_BROADCAST_MIN_BYTES` of output up and ``"native"``
below (small broadcasts pay ``w`` launches); reduce-scatter uses ``"all_to_all"`` at every size. NCCL and other
backends keep the native calls under ``"auto"``; an explicit algorithm runs on any backend.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_comm import buffers as _buffers
from zero_comm import shm as _shm
from zero_comm.rank_order import reduce_into

ALL_GATHER_ALGORITHMS = ("auto", "native", "broadcast", "all_to_all", "shm")
REDUCE_SCATTER_ALGORITHMS = ("auto", "native", "all_to_all", "shm")
# Output bytes from which "auto" all-gather on gloo switches from the native call to broadcasts (see the table).
GLOO_BROADCAST_MIN_BYTES = 2 << 20

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Works:
    """Several in-flight ``torch.distributed`` works waited together (the handle of a broadcast-based all-gather).

    ``wait(timeout)`` waits each in issue order, each with the same ``timeout`` (a ``timedelta``; None: the process
    group's timeout), so the total wait is bounded by the slowest part, not by the sum, as the parts run together.
    """

    __slots__ = ("_works",)

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Every part has completed (a poll, never blocks)."""
        return all(work.is_completed() for work in self._works)


class Done:
    """The work of a collective over a group of one: the local copy made when it was issued was all of it.

    Why not the backend's call: gloo's all-gather fills a new flat buffer of the whole output and copies it out,
    so a stage-3 unit gathered on one rank held twice its size (measured: +15 MiB at the peak of a 60m Llama
    step with parameters on NVMe); its all-to-all likewise needs a receive buffer per call."""

    __slots__ = ()

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def local_copy(output: torch.Tensor, input: torch.Tensor) -> Done:
    """A group of one: every all-gather, reduce-scatter (sum, avg, min, max, product of one value) and all-to-all
    is ``output = input``; copied unless they are the same memory (an in-place call)."""
    if output.data_ptr() != input.data_ptr() or output.numel() != input.numel():
        output.view(-1).copy_(input.reshape(-1))
    return Done()


def resolve(collective: str, algorithm: str, group, nbytes: int) -> str:
    """The algorithm to run: ``algorithm`` itself unless it is "auto"; for "auto" the per-backend/size choice.

    Args:
        collective: "all_gather_into_tensor" or "reduce_scatter_tensor".
        algorithm: one of :data:`ALL_GATHER_ALGORITHMS` / :data:`REDUCE_SCATTER_ALGORITHMS`.
        nbytes: the full buffer in bytes (all-gather output, reduce-scatter input).

    Returns "native" for a group of one or an empty buffer (nothing to move). Does not validate ``algorithm``.
    """
    if group.size() <= 1 or nbytes == 0:
        return "native"
    if algorithm != "auto":
        return algorithm
    if dist.get_backend(group) != "gloo":
        return "native"
    if collective == "reduce_scatter_tensor":
        return "all_to_all"
    return "broadcast" if nbytes >= GLOO_BROADCAST_MIN_BYTES else "native"


def shm_channel(group) -> _shm.ShmChannel:
    """The group's shared-memory channel for algorithm "shm" (the first call sets it up, collectively: every rank
    of ``group`` calls it at the same collective); ValueError naming why when the group cannot have one."""
    ch = _shm.channel(group) if dist.get_backend(group) == "gloo" else None
    if ch is None:
        raise ValueError(
            f"algorithm 'shm' needs a gloo group whose ranks share a host and /dev/shm (group of {group.size()}, "
            f"backend {dist.get_backend(group)}, ZERO_COMM_SHM={os.environ.get('ZERO_COMM_SHM', 'unset')})"
        )
    return ch


def start_all_gather(algorithm: str, output: torch.Tensor, input: torch.Tensor, group):
    """Issue an all-gather of ``input`` (k elements) into ``output`` (w*k) async; returns ``(work, algorithm)``,
    the algorithm that ran ("auto" resolved as :func:`resolve` does)."""
    world = group.size()
    if world == 1:
        return local_copy(output, input), "native"
    nbytes = output.numel() * output.element_size()
    if not nbytes:
        algorithm = "native"
    elif algorithm == "auto":
        gloo_large = nbytes >= GLOO_BROADCAST_MIN_BYTES and dist.get_backend(group) == "gloo"
        algorithm = "broadcast" if gloo_large else "native"
    if algorithm == "native":
        return _ALL_GATHER(output, input, group=group, async_op=True), algorithm
    if algorithm == "shm":
        ch = shm_channel(group)
        return ch.submit(ch.all_gather, output, input), algorithm
    rank = dist.get_rank(group)
    k = input.numel()
    out, inp = output.view(-1), input.reshape(-1)
    if algorithm == "all_to_all":
        return dist.all_to_all_single(out, inp.repeat(world), group=group, async_op=True), algorithm
    # "broadcast": slot i comes from group rank i; dist.broadcast takes the global rank.
    ranks = dist.get_process_group_ranks(group)
    out[rank * k : (rank + 1) * k].copy_(inp)
    works = [dist.broadcast(out[i * k : (i + 1) * k], ranks[i], group=group, async_op=True) for i in range(world)]
    return Works(works), algorithm


def start_reduce_scatter(algorithm: str, output: torch.Tensor, input: torch.Tensor, group, avg: bool):
    """Issue a reduce-scatter (sum, or the average when ``avg``) async; returns ``(work, finish, algorithm)``.

    ``finish`` (None when nothing is left) completes the result in ``wait``: for "all_to_all" the sum of the
    received chunks in rank order into ``output``; the division by the group size of an emulated average (every
    algorithm but NCCL's native call, which averages itself). ``algorithm``: the one that ran ("auto" resolved as
    :func:`resolve` does).
    """
    world = group.size()
    if world == 1:  # the average of one value is the value
        return local_copy(output, input), None, "native"
    if not input.numel():
        algorithm = "native"
    elif algorithm == "auto":
        algorithm = "all_to_all" if dist.get_backend(group) == "gloo" else "native"
    out = output.view(-1)
    if algorithm == "native":
        if avg and dist.get_backend(group) == "nccl":
            return _REDUCE_SCATTER(output, input, op=dist.ReduceOp.AVG, group=group, async_op=True), None, algorithm
        work = _REDUCE_SCATTER(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return work, (lambda: out.div_(world)) if avg else None, algorithm
    if algorithm == "shm":
        ch = shm_channel(group)
        work = ch.submit(ch.reduce_scatter, output, input, [output.numel()] * world)
        return work, (lambda: out.div_(world)) if avg else None, algorithm
    recv = _buffers.scratch.take(input.numel(), input.dtype, input.device)  # the same storage every step (CPU)
    work = dist.all_to_all_single(recv, input.reshape(-1), group=group, async_op=True)

    def sum_chunks() -> None:
        reduce_into(out, recv.view(world, -1))
        if avg:
            out.div_(world)
        _buffers.scratch.give(recv)

    return work, sum_chunks, algorithm
