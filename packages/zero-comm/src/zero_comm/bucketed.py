"""Bucketed all-reduce and reduce-scatter of a list of tensors (what a data-parallel runtime hands over: its
gradients), and the bucket planner every bucketing in zero uses.

A *bucket* is a run of tensors of one dtype and device reduced by one collective through one flat buffer (DDP's
``bucket_cap_mb``, Megatron-core's bucket, DeepSpeed's ``reduce_bucket_size``): fewer, larger collectives than one
per tensor, for a copy in and a copy out. :func:`plan_buckets` cuts a sequence of sizes into such runs; zero_core
cuts its layout buckets and its gradient reducer's reduction pieces with it.

- :func:`all_reduce_bucketed`: every tensor reduced over ranks, the result written back into it.
- :func:`reduce_scatter_bucketed`: every ``inputs[i]`` (``world * k_i`` elements) reduce-scattered into
  ``outputs[i]`` (``k_i`` elements), as :func:`~zero_comm.reduce_scatter_tensor` would, one collective per bucket
  (packed rank-major, :func:`~zero_comm.coalesced.pack_rank_major`); optionally through ZeRO++'s qgZ quantization
  (int8 or int4 blocks, :class:`~zero_comm.zeropp.QuantizedReduceScatter`).

Tensors are grouped by (dtype, device) in order of first appearance. Inside a group, buckets hold at most
``bucket_bytes`` bytes (of the tensors handed over; the reduce-scatter's inputs) and are filled from the end of the
list, the order backward produces gradients, as DDP fills them; a tensor larger than a bucket gets one of its own.
Every rank must hand over the same list (sizes, dtypes, order): the buckets, hence the collectives, then match.

Each bucket is one collective with its own :class:`~zero_comm.CommHandle` (``BucketedHandle.handles``, in the
order of ``BucketedHandle.buckets``); :meth:`BucketedHandle.wait` waits for them all within one timeout and names
the bucket that did not complete.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zero_comm.buffers import scratch
from zero_comm.coalesced import pack_rank_major, unpack_flat
from zero_comm.collectives import (
    _DONE,
    CommHandle,
    _all_reduce,
    _check_group,
    _check_op,
    _reduce_scatter,
    _reject,
    op_name,
)
from zero_comm.quantize import DEFAULT_BLOCK, check_params
from zero_comm.zeropp import QuantizedReduceScatter

# DDP's default bucket_cap_mb (25 MiB).
DEFAULT_BUCKET_BYTES = 25 * 2**20


def plan_buckets(sizes: Sequence[int], bucket_numel: int, *, from_end: bool = False) -> list[range]:
    """Cut items of ``sizes`` elements, in order, into contiguous runs of at most ``bucket_numel`` elements.

    Args:
        sizes: each item's element count (>= 0).
        bucket_numel: most elements per run (>= 1); an item larger than that is a run of its own.
        from_end: fill runs from the last item (the order backward produces gradients: the last runs are full,
            the first holds the rest), as DDP and DeepSpeed fill their buckets; else from the first.

    Returns:
        ``range``s of item indices covering ``0..len(sizes)-1`` in order, none empty (none for no items).

    Raises:
        ValueError: ``bucket_numel`` is not a positive int, or a size is negative (naming its index).
    """
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"plan_buckets: bucket_numel must be a positive int, got {bucket_numel!r}")
    n = len(sizes)
    runs: list[range] = []
    first = count = size = 0  # the current run: its first visited index, items and elements
    for i in range(n - 1, -1, -1) if from_end else range(n):
        k = sizes[i]
        if k < 0:
            raise ValueError(f"plan_buckets: sizes[{i}] is {k}; sizes must be >= 0")
        if count and size + k > bucket_numel:
            runs.append(range(first - count + 1, first + 1) if from_end else range(first, first + count))
            count = size = 0
        if not count:
            first = i
        count += 1
        size += k
    if count:
        runs.append(range(first - count + 1, first + 1) if from_end else range(first, first + count))
    return runs[::-1] if from_end else runs


@dataclass(frozen=True)
class TensorBucket:
    """One bucket of a bucketed collective.

    Attributes:
        index: its position among the call's buckets (the order they are issued in).
        positions: the positions of its tensors in the list handed over, ascending.
        dtype, device: of every tensor in it.
        numel: elements of its flat buffer (the sum of its tensors' elements; the reduce-scatter's inputs).
    """

    index: int
    positions: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    numel: int


def bucket_tensors(tensors: Sequence[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[TensorBucket]:
    """The buckets :func:`all_reduce_bucketed` (and :func:`reduce_scatter_bucketed`, of its inputs) forms for
    ``tensors``: grouped by (dtype, device) in order of first appearance, each group cut by :func:`plan_buckets`
    (``from_end``) into runs of at most ``bucket_bytes`` bytes.

    Raises:
        ValueError: ``bucket_bytes`` is not a positive int, or an item is not a tensor (naming its index).
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int (bytes per bucket), got {bucket_bytes!r}")
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        kinds.setdefault((t.dtype, t.device), []).append(i)
    buckets: list[TensorBucket] = []
    for (dtype, device), positions in kinds.items():
        sizes = [tensors[i].numel() for i in positions]
        cap = max(1, bucket_bytes // tensors[positions[0]].element_size())
        for run in plan_buckets(sizes, cap, from_end=True):
            held = tuple(positions[j] for j in run)
            buckets.append(TensorBucket(len(buckets), held, dtype, device, sum(sizes[j] for j in run)))
    return buckets


class BucketedHandle:
    """The collectives of one bucketed call: ``handles[i]`` reduces ``buckets[i]`` (:class:`TensorBucket`).

    A synchronous call returns it completed; after an asynchronous one, the tensors of bucket i are valid once
    ``handles[i].wait()`` (or :meth:`wait`) returned.
    """

    __slots__ = ("buckets", "handles")

    def __init__(self, buckets: list[TensorBucket], handles: list[CommHandle]) -> None:
        self.buckets = tuple(buckets)
        self.handles = tuple(handles)

    def ready(self) -> bool:
        """Every bucket's collective has completed on this rank (a poll, never blocks; ``CommHandle.ready``)."""
        return all(h.ready() for h in self.handles)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every bucket, in order, and write its results into the tensors handed over.

        Args:
            timeout: seconds for the whole wait (not per bucket); None: each collective's process-group timeout.

        Raises:
            CollectiveTimeout: a bucket's collective did not complete in the time left; its ``collective`` names the
                call, the bucket's index, its tensors' positions and dtype.
            CollectiveError: a bucket's collective failed otherwise.
        """
        if timeout is None:
            for h in self.handles:
                h.wait()
            return
        deadline = time.monotonic() + timeout
        for h in self.handles:
            h.wait(max(deadline - time.monotonic(), 1e-3))


def _label(name: str, b: TensorBucket, count: int) -> str:
    return f"{name} bucket {b.index} of {count} (tensors {list(b.positions)}, {b.dtype})"


def _check_floats(name, group, arg: str, tensors: Sequence[torch.Tensor], why: str) -> None:
    for i, t in enumerate(tensors):
        if not t.is_floating_point():
            raise _reject(name, group, f"{why} needs floating-point tensors; {arg}[{i}] is {t.dtype}")


def all_reduce_bucketed(
    tensors: Sequence[torch.Tensor],
    group=None,
    *,
    op="sum",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    async_op: bool = False,
) -> BucketedHandle:
    """Reduce every tensor of ``tensors`` over ranks, in place, one all-reduce per bucket (see the module docstring).

    Args:
        tensors: any shapes, dtypes (grouped) and layouts; distinct tensors; the same list on every rank.
        group: the process group; None: the default group.
        op: "sum", "avg", "max", "min" or "product", or the torch ``ReduceOp`` of that name ("avg": floating
            dtypes only; on gloo a sum divided by the group size).
        bucket_bytes: most bytes per bucket (default 25 MiB, DDP's ``bucket_cap_mb``).
        async_op: return at once; a tensor holds its result once its bucket's handle (or the whole handle) waited.

    Returns:
        a :class:`BucketedHandle`, completed unless ``async_op``.

    Raises:
        ValueError: an item that is not a tensor, an unknown op or "avg" of a non-float tensor (naming its index),
            a bad ``bucket_bytes`` (before communicating).
    A bucket of one contiguous tensor is reduced in place; the others go through a flat buffer of the process's
    scratch pool (``zero_comm.buffers.scratch``). Mirrors DDP's bucketed gradient all-reduce
    (``torch.nn.parallel.DistributedDataParallel``, ``bucket_cap_mb``).
    """
    name = "all_reduce_bucketed"
    group = _check_group(name, group)
    tensors = list(tensors)
    try:
        buckets = bucket_tensors(tensors, bucket_bytes)
    except ValueError as exc:
        raise _reject(name, group, str(exc)) from None
    if tensors:
        if op_name(op) == "avg":  # each tensor named, the first too
            _check_floats(name, group, "tensors", tensors, "op 'avg'")
        op = _check_op(name, group, op, ("sum", "avg", "max", "min", "product"), tensors[0])
    handles = []
    for b in buckets:
        members = [tensors[i] for i in b.positions]
        if len(members) == 1 and members[0].is_contiguous():
            flat, post = members[0], None
        else:
            flat = scratch.take(b.numel, b.dtype, b.device)
            torch.cat([t.reshape(-1) for t in members], out=flat)
            post = _write_back(flat, members, (flat,))
        describe = (_label(name, b, len(buckets)), group, (("bucket", flat),))
        handles.append(_all_reduce(flat, group, op, True, "auto", name, post, describe))
    handle = BucketedHandle(buckets, handles)
    if not async_op:
        handle.wait()
    return handle


def _write_back(flat: torch.Tensor, outputs: list[torch.Tensor], pooled: tuple[torch.Tensor, ...]):
    """What a bucket's handle runs once its collective completed: ``flat``'s pieces into ``outputs``, then the
    scratch buffers ``pooled`` back to the pool."""

    def finish() -> None:
        unpack_flat(flat, outputs)
        for buf in pooled:
            scratch.give(buf)

    return finish


def reduce_scatter_bucketed(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group=None,
    *,
    op="sum",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    async_op: bool = False,
    bits: int | None = None,
    block: int = DEFAULT_BLOCK,
    quantizer: str = "torch",
) -> BucketedHandle:
    """Reduce-scatter every ``inputs[i]`` into ``outputs[i]``, one collective per bucket (see the module docstring).

    Args:
        outputs: ``outputs[i]`` gets chunk ``rank`` of ``inputs[i]`` reduced over ranks (``k_i`` elements, any
            shape and layout; ``inputs[i]``'s dtype and device).
        inputs: ``inputs[i]`` has ``world * k_i`` elements (any shape and layout); not modified. Buckets are cut
            by the inputs' bytes.
        group: the process group; None: the default group.
        op: "sum" or "avg", or torch's ``ReduceOp.SUM`` / ``ReduceOp.AVG`` ("avg": floating dtypes only).
        bucket_bytes: most input bytes per bucket (default 25 MiB).
        async_op: return at once; an output holds its result once its bucket's handle (or the whole handle)
            waited. Quantized buckets are always reduced before the call returns (qgZ's second stage needs the
            first's sums).
        bits: None (exact), or 8 / 4 for ZeRO++ qgZ: each bucket quantized blockwise (one fp32 scale per ``block``
            elements) and exchanged by all-to-all, summed in fp32; floating dtypes only. Error: at most half a
            block's scale per element and rank (:class:`~zero_comm.zeropp.QuantizedReduceScatter`).
        block, quantizer: qgZ's block size and registered kernels (``zero_comm.quantize``).

    Returns:
        a :class:`BucketedHandle`, completed unless ``async_op`` (and not quantized).

    Raises:
        ValueError: list lengths differ, an item that is not a tensor, dtype/device of ``outputs[i]`` and
            ``inputs[i]`` differ, ``inputs[i]`` not ``world`` times ``outputs[i]``, an unknown op, "avg" or qgZ of a
            non-float tensor (each naming the index), bad ``bits``/``block``/``bucket_bytes`` (before
            communicating).
    A bucket of one contiguous pair is reduced straight into its output; the others through flat buffers of the
    scratch pool. Mirrors FSDP2's ``foreach_reduce`` (one reduce-scatter of the gradients packed rank-major).
    """
    name = "reduce_scatter_bucketed"
    group = _check_group(name, group)
    world = group.size()
    outputs, inputs = list(outputs), list(inputs)
    if len(outputs) != len(inputs):
        raise _reject(name, group, f"outputs ({len(outputs)}) and inputs ({len(inputs)}) must have the same length")
    for i, (o, x) in enumerate(zip(outputs, inputs, strict=True)):
        if not isinstance(o, torch.Tensor):
            raise _reject(name, group, f"outputs[{i}] must be a torch.Tensor, got {type(o).__name__}")
        if not isinstance(x, torch.Tensor):
            raise _reject(name, group, f"inputs[{i}] must be a torch.Tensor, got {type(x).__name__}")
        if o.dtype != x.dtype or o.device != x.device:
            raise _reject(name, group, f"outputs[{i}] is {o.dtype} on {o.device} but inputs[{i}] is {x.dtype} on "
                          f"{x.device}")  # fmt: skip
        if x.numel() != world * o.numel():
            why = f"world size {world} x outputs[{i}] shape {tuple(o.shape)}"
            raise _reject(name, group, f"inputs[{i}] has shape {tuple(x.shape)} ({x.numel()} elements) but "
                          f"expected {world * o.numel()} ({why})")  # fmt: skip
    try:
        buckets = bucket_tensors(inputs, bucket_bytes)
        if bits is not None:
            check_params(bits, block)
    except ValueError as exc:
        raise _reject(name, group, str(exc).replace("tensors[", "inputs[")) from None
    qgz = None
    if inputs:
        if op_name(op) == "avg":  # each input named, the first too
            _check_floats(name, group, "inputs", inputs, "op 'avg'")
        op = _check_op(name, group, op, ("sum", "avg"), inputs[0])
        if bits is not None:
            _check_floats(name, group, "inputs", inputs, f"qgZ quantization (bits={bits})")
            qgz = QuantizedReduceScatter(group, bits=bits, block=block, quantizer=quantizer)
    handles = []
    for b in buckets:
        outs = [outputs[i] for i in b.positions]
        ins = [inputs[i] for i in b.positions]
        direct = len(outs) == 1 and outs[0].is_contiguous() and ins[0].is_contiguous()
        if direct:
            reduced, packed, post = outs[0], ins[0], None
        else:
            total = b.numel // world
            packed = scratch.take(b.numel, b.dtype, b.device)
            pack_rank_major(ins, [o.numel() for o in outs], world, packed)
            reduced = scratch.take(total, b.dtype, b.device)
            post = _write_back(reduced, outs, (reduced, packed))
        if qgz is not None:
            qgz(reduced.view(-1), packed.view(-1), op=op)
            if post is not None:
                post()
            handles.append(_DONE)
            continue
        describe = (_label(name, b, len(buckets)), group, (("output", reduced), ("input", packed)))
        handles.append(_reduce_scatter(reduced, packed, group, op, True, name, post, describe=describe))
    handle = BucketedHandle(buckets, handles)
    if not async_op:
        handle.wait()
    return handle
