"""ZeRO++ collectives (arXiv 2306.10209): qwZ quantized all-gather, qgZ quantized reduce-scatter, hpZ all-gather.

Wire format of one quantized piece: a uint8 buffer ``[data bytes | fp32 scales as bytes]`` of
``payload_bytes(numel, bits, block)`` bytes, so one collective carries values and scales together.

- qwZ (section 3.1): each rank quantizes its shard (int8 by default), all-gathers the bytes, and every rank,
  itself included, dequantizes every shard, so all ranks hold identical weights.
- qgZ (section 3.3): gradients are quantized (int4 by default) and exchanged by all-to-all instead of a
  reduce-scatter; first within the node (each rank receives the pieces it will reduce for its local index on every
  node), dequantized and summed in fp32, then the partial sums are re-quantized and exchanged across nodes with the
  ranks of the same local index, dequantized and summed in fp32. Slices are reordered before the first stage so
  rank g ends up with chunk g, as a plain reduce-scatter would give.
- hpZ (section 3.2): a secondary copy of the parameters partitioned within the node only; the forward/backward
  all-gather then runs inside the node. The secondary shard of local index j is the concatenation of the primary
  shards of the ranks with local index j on every node (one inter-node all-gather after each optimizer step), so
  the intra-node gather plus a transpose copy reproduces the plain all-gather bit for bit.
"""

from __future__ import annotations

import torch

from zero_comm.collectives import _DONE, CommHandle, _all_gather, _all_to_all, _check_group, _reject
from zero_comm.quantize import (
    DEFAULT_BLOCK,
    QuantizedTensor,
    check_params,
    get_quantizer,
    padded_numel,
    payload_bytes,
)
from zero_comm.topology import HierarchicalGroups


def _pack(qt: QuantizedTensor, out: torch.Tensor) -> None:
    """Write ``qt``'s data then scales (as bytes) into the uint8 tensor ``out``."""
    nd = qt.data.numel()
    out[:nd].copy_(qt.data.view(torch.uint8))
    out[nd:].copy_(qt.scales.view(torch.uint8))


def _unpack(buf: torch.Tensor, numel: int, bits: int, block: int) -> QuantizedTensor:
    p = padded_numel(numel, block)
    nd = p * bits // 8
    data = buf[:nd] if bits == 4 else buf[:nd].view(torch.int8)
    scales = buf[nd : nd + (p // block) * 4].view(torch.float32)
    return QuantizedTensor(data, scales, numel, bits, block)


def _check_floats(name, group, **tensors) -> None:
    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.is_contiguous():
            got = f"{t.dtype}, contiguous={t.is_contiguous()}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise _reject(name, group, f"{arg} must be a contiguous floating-point tensor, got {got}")


def _check_size(name, group, arg: str, t: torch.Tensor, expected: int, why: str) -> None:
    if t.numel() != expected:
        raise _reject(
            name, group, f"{arg} has shape {tuple(t.shape)} ({t.numel()} elements) but expected {expected} elements "
            f"({why}, group size {group.size()})",
        )  # fmt: skip


class QuantizedAllGather:
    """qwZ: all-gather of float shards through blockwise int8 (or int4) quantization.

    Args:
        group: the process group; None: the default group.
        bits: 8 (default, as ZeRO++ qwZ) or 4.
        block: elements per quantization block (default 4096, see zero_comm.quantize).
        quantizer: registered kernel name ("torch" is the reference).

    Error: every element of the result is within its block's ``scale / 2`` of the true value, on every rank
    (including this rank's own shard, which is also dequantized so that all ranks agree).
    """

    def __init__(self, group=None, *, bits: int = 8, block: int = DEFAULT_BLOCK, quantizer: str = "torch"):
        group = _check_group("QuantizedAllGather", group)
        check_params(bits, block)
        self.group, self.bits, self.block = group, bits, block
        self.quantizer = get_quantizer(quantizer)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> CommHandle:
        """Gather every rank's ``input`` (k elements) into ``output`` (world * k elements, any float dtype).

        Raises:
            ValueError: wrong output size or non-float/non-contiguous tensors (before communicating).
        """
        name, group, world = "qwz_all_gather", self.group, self.group.size()
        _check_floats(name, group, output=output, input=input)
        _check_size(name, group, "output", output, world * input.numel(), f"world x input shape {tuple(input.shape)}")
        return self.gather_packed(output, self.pack(input), async_op=async_op)

    def pack(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` (k elements, any float dtype) quantized into this gather's wire form: a new uint8 tensor of
        ``payload_bytes(k, bits, block)`` bytes (data, then the fp32 scales as bytes). A caller may keep it and
        gather it any number of times with :meth:`gather_packed` (stage 3's frozen weights held quantized)."""
        k = input.numel()
        send = torch.empty(payload_bytes(k, self.bits, self.block), dtype=torch.uint8, device=input.device)
        _pack(self.quantizer.quantize(input, self.bits, self.block), send)
        return send

    def unpack(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``numel`` values ``payload`` (from :meth:`pack`) holds, dequantized into a new ``dtype`` tensor."""
        return self.quantizer.dequantize(_unpack(payload, numel, self.bits, self.block), dtype)

    def gather_packed(self, output: torch.Tensor, payload: torch.Tensor, *, async_op: bool = False) -> CommHandle:
        """Gather every rank's ``payload`` (from :meth:`pack` of k = ``output.numel() / world`` elements) and
        dequantize each into its k elements of ``output`` (any float dtype; done by ``wait()`` when asynchronous).

        Raises:
            ValueError: ``output`` not float or not a multiple of the world size, or ``payload`` not the uint8
                wire form of k elements (before communicating).
        """
        name, group, world = "qwz_all_gather", self.group, self.group.size()
        _check_floats(name, group, output=output)
        k = output.numel() // world
        size = payload_bytes(k, self.bits, self.block)
        _check_size(name, group, "output", output, world * k, "a multiple of the world size")
        if payload.dtype != torch.uint8 or payload.numel() != size:
            raise _reject(name, group, f"payload must be {size} uint8 bytes (the packed form of {k} elements), "
                          f"got {payload.numel()} of {payload.dtype}")  # fmt: skip
        recv = torch.empty(world * size, dtype=torch.uint8, device=payload.device)
        flat_out = output.view(-1)

        def dequantize() -> None:
            for r in range(world):
                qt = _unpack(recv[r * size : (r + 1) * size], k, self.bits, self.block)
                flat_out[r * k : (r + 1) * k] = self.quantizer.dequantize(qt, output.dtype)

        return _all_gather(recv, payload, group, async_op, name, dequantize)


def _quantized_exchange(name, group, pieces: torch.Tensor, bits, block, quantizer) -> torch.Tensor:
    """All-to-all of the rows of ``pieces`` (world x n, float) through quantization; returns the fp32 sum of the
    world received rows (n elements)."""
    world, n = pieces.shape
    size = payload_bytes(n, bits, block)
    send = torch.empty(world * size, dtype=torch.uint8, device=pieces.device)
    for j in range(world):
        _pack(quantizer.quantize(pieces[j], bits, block), send[j * size : (j + 1) * size])
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group, False, name)
    total = torch.zeros(n, dtype=torch.float32, device=pieces.device)
    for j in range(world):
        total += quantizer.dequantize(_unpack(recv[j * size : (j + 1) * size], n, bits, block), torch.float32)
    return total


class QuantizedReduceScatter:
    """qgZ: reduce-scatter through blockwise int4 (default) or int8 quantization and two all-to-all stages.

    Args:
        groups: a :class:`HierarchicalGroups` (intra-node stage, then inter-node stage) or a plain process group
            (one all-to-all stage over the whole group); None: the default group.
        bits: 4 (default, as ZeRO++ qgZ) or 8. block: elements per block (default 4096). quantizer: kernel name.

    Error: each stage adds at most ``scale / 2`` per element and per received piece. On Gaussian data with block
    256 one stage gives a relative L2 error of about 3 / (qmax * sqrt(12)) (int8 0.007, int4 0.12), two stages
    sqrt(2) times that; the tests bound it at 0.015 (int8) and 0.25 (int4) on 2-4 ranks.
    Synchronous: stage 2 needs stage 1's sums; the returned handle is already complete.
    """

    def __init__(
        self,
        groups: HierarchicalGroups | torch.distributed.ProcessGroup | None = None,
        *,
        bits: int = 4,
        block: int = DEFAULT_BLOCK,
        quantizer: str = "torch",
    ):
        check_params(bits, block)
        if isinstance(groups, HierarchicalGroups):
            self.group, self.intra, self.inter = groups.group, groups.intra, groups.inter
            self.node_size, self.num_nodes = groups.node_size, groups.num_nodes
        else:
            groups = _check_group("QuantizedReduceScatter", groups)
            self.group = self.intra = self.inter = groups
            self.node_size, self.num_nodes = groups.size(), 1
        self.bits, self.block = bits, block
        self.quantizer = get_quantizer(quantizer)

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, op: str = "sum") -> CommHandle:
        """Reduce ``input`` (world * k elements) over ranks; leave chunk ``rank`` in ``output`` (k elements).

        Raises:
            ValueError: sizes wrong (input not world x output), non-float tensors, op not "sum"/"avg".
        """
        name, group = "qgz_reduce_scatter", self.group
        world, m, n = group.size(), self.node_size, self.num_nodes
        _check_floats(name, group, output=output, input=input)
        _check_size(name, group, "input", input, world * output.numel(), f"world x output shape {tuple(output.shape)}")
        if op not in ("sum", "avg"):
            raise _reject(name, group, f"op must be one of ('sum', 'avg'), got {op!r}")
        k = output.numel()
        # chunks[node', j'] is the chunk that global group rank node' * m + j' must end with
        chunks = input.reshape(n, m, k)
        if m > 1:
            # intra-node stage: local j' receives, from each node peer, chunks (node', j') for every node'
            pieces = chunks.transpose(0, 1).reshape(m, n * k)
            partial = _quantized_exchange("qgz_all_to_all_intra", self.intra, pieces, self.bits, self.block,
                                          self.quantizer).view(n, k)  # fmt: skip
        else:
            partial = chunks[:, 0, :].to(torch.float32)
        if n > 1:
            result = _quantized_exchange("qgz_all_to_all_inter", self.inter, partial, self.bits, self.block,
                                         self.quantizer)  # fmt: skip
        else:
            result = partial[0]
        if op == "avg":
            result = result / world
        output.view(-1).copy_(result)
        return _DONE


class HierarchicalAllGather:
    """hpZ: all-gather of parameters from a secondary partition held within the node.

    Args:
        groups: from :func:`hierarchical_groups` (node size = hpZ's secondary partition size).
        bits: None (exact; bitwise equal to a plain all-gather) or 8/4 to combine with qwZ quantization.
        block, quantizer: as :class:`QuantizedAllGather`.
    """

    def __init__(
        self, groups: HierarchicalGroups, *, bits: int | None = None, block: int = DEFAULT_BLOCK, quantizer="torch"
    ):
        if bits is not None:
            check_params(bits, block)
        self.groups = groups
        self.bits, self.block = bits, block
        self.qwz = QuantizedAllGather(groups.intra, bits=bits, block=block, quantizer=quantizer) if bits else None

    def secondary_shard(self, primary: torch.Tensor) -> torch.Tensor:
        """Build this rank's secondary shard (``num_nodes * k`` elements) from its primary shard (k elements).

        One inter-node all-gather; synchronous on purpose: DeepSpeed's hpZ once read an asynchronously copied
        secondary shard before the copy finished (DeepSpeed PR #5216). Call after every optimizer step.
        """
        g = self.groups
        out = torch.empty(g.num_nodes * primary.numel(), dtype=primary.dtype, device=primary.device)
        _all_gather(out, primary.reshape(-1), g.inter, False, "hpz_secondary_all_gather")
        return out

    def __call__(self, output: torch.Tensor, secondary: torch.Tensor, *, async_op: bool = False) -> CommHandle:
        """Gather the full tensor (``world * k`` elements, primary rank order) from the node's secondary shards.

        Raises:
            ValueError: ``output`` is not ``node_size * secondary.numel()`` elements or dtypes differ.
        """
        g = self.groups
        name, m, n = "hpz_all_gather", g.node_size, g.num_nodes
        k = secondary.numel() // n if n else 0
        if secondary.numel() % n or output.numel() != m * secondary.numel():
            raise _reject(
                name, g.intra, f"output has shape {tuple(output.shape)} ({output.numel()} elements) but expected "
                f"{m * secondary.numel()} (node size {m} x secondary {tuple(secondary.shape)}, a multiple of {n})",
            )  # fmt: skip
        tmp = torch.empty(m * n * k, dtype=output.dtype, device=output.device)

        def reorder() -> None:
            output.view(n, m, k).copy_(tmp.view(m, n, k).transpose(0, 1))

        if self.qwz is not None:
            handle = self.qwz(tmp, secondary, async_op=True)
            inner_wait = handle.wait

            def wait_then_reorder() -> None:
                inner_wait()
                reorder()

            result = CommHandle(None, wait_then_reorder, None)
            if not async_op:
                result.wait()
            return result
        return _all_gather(tmp, secondary.reshape(-1), g.intra, async_op, name, reorder)
