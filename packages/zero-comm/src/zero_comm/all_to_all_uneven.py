"""All-to-all with variable split sizes (all-to-all-v), and the exchange of split sizes it needs: what an
expert-parallel runtime dispatches tokens to experts (and combines them back) with.

A dispatch is two calls: ``output_split_sizes = exchange_split_sizes(input_split_sizes, group)`` (each rank
learns how many rows every peer sends it), then ``all_to_all_v(output, input, output_split_sizes,
input_split_sizes, group)``. Splits of zero rows are allowed anywhere (an expert that gets no tokens from a rank),
as is a rank that sends or receives nothing at all; every rank still enters both calls, so none hangs.

Split sizes are counted in rows of dim 0, as torch's ``all_to_all_single`` counts them. They are checked on this
rank before anything is sent (``ValueError`` naming the argument, the sum expected and the tensor's dim-0 size; the
rejecting rank leaves the notice its peers' timeouts quote, :mod:`zero_comm.collectives`). That the peers' sizes
agree (rank i's ``input_split_sizes[j]`` = rank j's ``output_split_sizes[i]``) cannot be checked without a
message (except for j = i, checked); :func:`exchange_split_sizes` makes them agree by construction. gloo enforces
the sizes it receives: a peer that sends more rows than expected fails the call with gloo's error.

**Timeouts.** ``wait(timeout)`` raises :class:`~zero_comm.collectives.CollectiveTimeout` naming the call, this
rank, the group's global ranks, the tensors and both split-size lists, and a peer's rejection notice if one was
left (which names the rank that did not arrive because it rejected its input). A rank that never calls at all
leaves no trace the backend could report, so the timeout names the ranks expected rather than the one missing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm.collectives import (
    CollectiveError,
    CollectiveTimeout,
    CommHandle,
    _check_group,
    _check_pair,
    _is_nccl,
    _issue,
    _read_notice,
    _reject,
    _shape,
)


class _AllToAllVFailure:
    """Names an all-to-all-v whose work failed; a ``FailureDescription``."""

    __slots__ = ("name", "group", "output", "input", "output_splits", "input_splits")

    def __init__(self, name: str, group, output, input, output_splits: list[int], input_splits: list[int]) -> None:
        self.name = name
        self.group = group
        self.output = output
        self.input = input
        self.output_splits = output_splits
        self.input_splits = input_splits

    def failure(self, exc: Exception) -> CollectiveError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        low = str(exc).lower()
        kind = CollectiveTimeout if ("timeout" in low or "timed out" in low) else CollectiveError
        ranks = dist.get_process_group_ranks(self.group)
        sizes = (
            f"output {_shape(self.output)} with output_split_sizes {self.output_splits}, input "
            f"{_shape(self.input)} with input_split_sizes {self.input_splits}, among global ranks {ranks}"
        )
        return kind(self.name, self.group.size(), dist.get_rank(), sizes, text, _read_notice(self.group))


def _counts(name: str, group, arg: str, splits) -> list[int]:
    """``splits`` as a list of ints, one non-negative count per rank of ``group`` (else ValueError)."""
    world = group.size()
    try:
        counts = [int(n) for n in splits]
        whole = all(int(n) == n for n in splits)
    except (TypeError, ValueError):
        counts, whole = [], False
    if not whole or len(counts) != world or any(n < 0 for n in counts):
        raise _reject(name, group, f"{arg} must hold {world} non-negative integer row counts (one per rank of the "
                      f"group), got {splits!r}")  # fmt: skip
    return counts


def _check_splits(name: str, group, arg: str, splits, t: torch.Tensor) -> list[int]:
    counts = _counts(name, group, arg, splits)
    tensor = arg.split("_")[0]
    if t.dim() == 0:
        raise _reject(name, group, f"{tensor} must have a dim 0 to split, got {_shape(t)}")
    if sum(counts) != t.shape[0]:
        raise _reject(name, group, f"{arg} {counts} add up to {sum(counts)} rows but {tensor} has dim-0 size "
                      f"{t.shape[0]} ({_shape(t)})")  # fmt: skip
    return counts


def all_to_all_v(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group=None,
    *,
    async_op: bool = False,
) -> CommHandle:
    """All-to-all with a row count per rank: rows ``input[off_j : off_j + input_split_sizes[j]]`` go to rank j,
    which receives them as its ``output`` rows ``[off'_i : off'_i + output_split_sizes[i]]`` (i this rank; offsets
    are the running sums of the sizes).

    Args:
        output: contiguous, dim 0 of ``sum(output_split_sizes)`` rows (may be 0), the same trailing shape, dtype
            and device as ``input``.
        input: contiguous, dim 0 of ``sum(input_split_sizes)`` rows (may be 0).
        output_split_sizes: one non-negative row count per rank of ``group``: what each rank sends this one
            (as :func:`exchange_split_sizes` returns).
        input_split_sizes: one non-negative row count per rank of ``group``: what this rank sends each.
        group: the process group; None: the default group.
        async_op: return at once; ``output`` is valid after ``wait``.

    Raises:
        ValueError: counts of the wrong length, negative or not integers, counts whose sum differs from the
            tensor's dim-0 size (naming the argument, the sum and the size), ``output_split_sizes[rank]`` unequal
            to ``input_split_sizes[rank]`` (the rows this rank sends itself), different trailing shapes,
            dtype/device mismatch or non-contiguous tensors (before communicating).
    Mirrors ``torch.distributed.all_to_all_single`` with ``output_split_sizes`` and ``input_split_sizes``.
    The record's ``wire_bytes`` are the bytes this rank sends to other ranks.
    """
    name = "all_to_all_v"
    group = _check_group(name, group)
    _check_pair(name, group, output, input)
    out_splits = _check_splits(name, group, "output_split_sizes", output_split_sizes, output)
    in_splits = _check_splits(name, group, "input_split_sizes", input_split_sizes, input)
    if tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise _reject(name, group, f"output {_shape(output)} and input {_shape(input)} differ beyond dim 0")
    me = dist.get_rank(group)
    if out_splits[me] != in_splits[me]:  # the rows a rank sends itself are the rows it receives from itself
        raise _reject(name, group, f"output_split_sizes[{me}] = {out_splits[me]} must equal input_split_sizes[{me}] "
                      f"= {in_splits[me]}: rank {me} sends itself what it receives from itself")  # fmt: skip
    describe = _AllToAllVFailure(name, group, output, input, out_splits, in_splits)
    work = dist.all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=True)
    row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
    sent = (sum(in_splits) - in_splits[me]) * row_bytes
    return _issue(name, group, work, async_op, input, describe, wire_bytes=sent)


def exchange_split_sizes(input_split_sizes: list[int], group=None, *, timeout: float | None = None) -> list[int]:
    """Tell every rank how many rows this one sends it, and learn what each sends this one: returns the
    ``output_split_sizes`` for :func:`all_to_all_v` (``result[i]`` = rank i's ``input_split_sizes[this rank]``).

    One equal-split all-to-all of int64 counts (on the current CUDA device for an NCCL group, else on the CPU),
    waited before returning. Every rank of ``group`` must call it.

    Args:
        input_split_sizes: one non-negative integer row count per rank of ``group`` (zeros allowed).
        group: the process group; None: the default group.
        timeout: seconds to wait; None: the process group's timeout.

    Raises:
        ValueError: counts of the wrong length, negative or not integers (before communicating).
        CollectiveTimeout: the exchange did not complete in time (names this rank and the group's size).
    """
    name = "exchange_split_sizes"
    group = _check_group(name, group)
    counts = _counts(name, group, "input_split_sizes", input_split_sizes)
    device = torch.device("cuda", torch.cuda.current_device()) if _is_nccl(group) else torch.device("cpu")
    send = torch.tensor(counts, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    describe = (name, group, (("input_split_sizes", send), ("output_split_sizes", recv)))
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    _issue(name, group, work, True, send, describe, kind="all_to_all_single").wait(timeout)
    return [int(n) for n in recv.tolist()]
