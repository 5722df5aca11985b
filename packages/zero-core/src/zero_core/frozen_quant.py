"""Frozen parameters held as int8 blocks at stage 3 (ZeRO++'s ``zero_quantized_nontrainable_weights``).

With the key on, the stage-3 store keeps this rank's chunk of every unit of a *frozen* flat group as blockwise
symmetric int8. The runtime puts every parameter with ``requires_grad=False`` there (the base weights of a LoRA
model), even one the optimizer lists, as DeepSpeed's stage 3 leaves such parameters out of its groups (so it cannot
be unfrozen later); a runtime without optimizer holds every parameter there. Each chunk takes one fp32 scale per
``zeropp_block_size`` elements (zero_comm's quantizer; ``zeropp_quantizer`` picks a registered kernel):
``payload_bytes(chunk, 8, block)`` bytes instead of ``chunk * itemsize``, about a quarter of fp32's (a half of
bf16's), and no copy in the storage dtype. A gather all-gathers those bytes (zero_comm's
``QuantizedAllGather.gather_packed``) and dequantizes every rank's chunk into the unit's full buffer in the compute
dtype, so the wire carries int8 too. Each element then differs from the value it was built from by at most its
block's ``scale / 2`` (``scale = absmax / 127``); every rank holds the same values. Trainable flat groups are
untouched.

DeepSpeed 0.19.8 quantizes a parameter's partition when it is partitioned with ``requires_grad=False``
(``partition_parameters.py``) and gathers the int8 partitions with their scales; its checkpoints save the int8
partition without its scales. Here what a checkpoint saves for a frozen group is the dequantized shard in the
parameter dtype (``shard_values``), so the checkpoint format is the unquantized one (portable, reshardable) and a
load quantizes the values again: a value already on the int8 grid quantizes back to the same int8 code, so a
save/load round trip keeps the model's values to within one ulp of each block's scale.
"""

from __future__ import annotations

import torch

from zero_comm import QuantizedAllGather
from zero_core.layout import Bucket, FlatGroup
from zero_core.param_record import record_for, record_of

BITS = 8  # the key stores int8 (DeepSpeed's CUDAQuantizer for non-trainable weights)


class QuantizedFrozenChunks:
    """This rank's chunks of the frozen units, each in ``QuantizedAllGather``'s packed wire form: the stage-3
    store's storage policy (``zero_core.shard_storage.ShardStorage``) for the frozen flat groups.

    Args:
        group: the data-parallel process group the units are gathered over.
        block: elements per quantization block (one fp32 scale each).
        quantizer: a zero_comm registry name (``"torch"`` is the reference; zero registers a CUDA kernel).
        dtype: the storage dtype :meth:`read` gives the dequantized values in.

    Attributes:
        packed: ``Bucket`` -> its chunk as uint8 bytes (``payload_bytes(b.chunk, 8, block)``: int8 data padded to
            whole blocks, then the fp32 scales).
    """

    offloaded = False
    batches = False  # each unit all-gathers its own packed bytes

    def __init__(self, group, *, block: int, quantizer: str, dtype: torch.dtype):
        self.block, self.dtype = block, dtype
        self.gather = QuantizedAllGather(group, bits=BITS, block=block, quantizer=quantizer)
        self.packed: dict[Bucket, torch.Tensor] = {}
        self._open: dict[Bucket, torch.Tensor] = {}  # unit -> the fp32 chunk open_chunk() gave, packed by close_chunk

    @staticmethod
    def holds_group(g: FlatGroup) -> bool:
        """True for the flat groups whose chunks are held quantized: the frozen ones."""
        return g.group_index is None

    def allocate(self, groups: list[FlatGroup]) -> None:
        """Nothing up front: each chunk is packed when it is written."""

    def shard(self, g: FlatGroup) -> None:
        """None: no copy in the storage dtype is kept."""
        return None

    def source(self, b: Bucket, ahead: bool, schedule) -> torch.Tensor:
        """Unit ``b``'s chunk dequantized (the stage-3 store gathers these units with :meth:`gather_unit`)."""
        return self.read_chunk(b)

    def gathered(self, b: Bucket) -> None:
        """Nothing staged."""

    def read_chunk(self, b: Bucket) -> torch.Tensor:
        """Unit ``b``'s stored chunk dequantized (a new tensor of ``b.chunk`` elements in the storage dtype)."""
        return self.gather.unpack(self.packed[b], b.chunk, self.dtype)

    @torch.no_grad()
    def open_chunk(self, b: Bucket, keep: bool) -> torch.Tensor:
        """An fp32 chunk to fill (quantized by :meth:`close_chunk`, so values of any float dtype up to fp32 are
        quantized from their exact value)."""
        if keep:
            chunk = self.gather.unpack(self.packed[b], b.chunk, torch.float32)
        else:
            chunk = torch.empty(b.chunk, dtype=torch.float32, device=b.group.device)
        self._open[b] = chunk
        return chunk

    @torch.no_grad()
    def close_chunk(self, b: Bucket) -> None:
        """Quantize the chunk :meth:`open_chunk` gave and keep it as unit ``b``'s stored chunk."""
        self.packed[b] = self.gather.pack(self._open.pop(b).reshape(-1))

    def flush(self) -> None:
        """Nothing: a chunk is stored when it is closed."""

    def gather_unit(self, b: Bucket, out: torch.Tensor):
        """Start gathering unit ``b`` into ``out`` (``b.padded_numel`` elements, a float dtype); the handle's
        ``wait()`` dequantizes every rank's chunk."""
        return self.gather.gather_packed(out, self.packed[b], async_op=True)

    def nbytes(self, g: FlatGroup) -> int:
        """Bytes this rank holds for frozen group ``g``: per unit, ``b.chunk`` int8 values padded to whole blocks
        plus one fp32 scale per block (``zero_comm.quantize.payload_bytes``)."""
        return sum(self.packed[b].numel() for b in g.buckets)

    def resident(self) -> list[torch.Tensor]:
        """The packed chunks."""
        return list(self.packed.values())

    def close(self) -> None:
        self.packed.clear()
        self._open.clear()


def ask_int8_if_frozen(p: torch.nn.Parameter) -> None:
    """``zero_init``'s ``on_partition`` hook for ``zero.Init(zero_quantized_nontrainable_weights=True)``: the stage-3
    runtime that takes ``p`` over holds it as int8 when it is frozen, as the config key would."""
    record_for(p).int8_if_frozen = True


def asked_int8(p: torch.Tensor) -> bool:
    """True when ``p`` was partitioned with :func:`ask_int8_if_frozen`."""
    rec = record_of(p)
    return rec is not None and rec.int8_if_frozen


def init_asked_quantized(flat_groups: list[FlatGroup]) -> bool:
    """A frozen parameter was partitioned by ``zero.Init(zero_quantized_nontrainable_weights=True)``; the same answer
    on every rank (partitioning is collective)."""
    return any(asked_int8(s.param) for g in flat_groups if QuantizedFrozenChunks.holds_group(g) for s in g.slots)
