"""Collectives, point-to-point send/recv, all-to-all-v, bucketed gradient reduction, ZeRO++ quantized collectives
(qwZ/qgZ/hpZ), comm logging and a multi-rank test harness."""

from importlib.metadata import version as _version

from zero_comm.agreement import AgreementTimeout, GroupOperationError, agree, same_outcome
from zero_comm.all_to_all_uneven import all_to_all_v, exchange_split_sizes
from zero_comm.bucketed import (
    DEFAULT_BUCKET_BYTES,
    BucketedHandle,
    TensorBucket,
    all_reduce_bucketed,
    bucket_tensors,
    plan_buckets,
    reduce_scatter_bucketed,
)
from zero_comm.coalesced import all_gather_coalesced, reduce_scatter_coalesced
from zero_comm.collectives import (
    CollectiveError,
    CollectiveTimeout,
    CommHandle,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    broadcast,
    op_name,
    reduce_scatter_tensor,
    reduce_scatter_uneven,
)
from zero_comm.compressed import compressed_all_reduce, compressed_numel, compressed_wire_bytes
from zero_comm.logger import CommRecord, CommsLogger
from zero_comm.p2p import P2PError, P2PHandle, P2POp, P2PTimeout, batch_send_recv, recv, send
from zero_comm.quantize import (
    DEFAULT_BLOCK,
    QuantizedTensor,
    Quantizer,
    dequantize_blockwise,
    get_quantizer,
    quantize_blockwise,
    register_quantizer,
)
from zero_comm.topology import HierarchicalGroups, data_parallel_group, hierarchical_groups
from zero_comm.zeropp import HierarchicalAllGather, QuantizedAllGather, QuantizedReduceScatter

__version__ = _version("zero-comm")  # the one version lives in pyproject.toml; read from the installed metadata

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BucketedHandle",
    "TensorBucket",
    "all_reduce_bucketed",
    "bucket_tensors",
    "plan_buckets",
    "reduce_scatter_bucketed",
    "op_name",
    "AgreementTimeout",
    "GroupOperationError",
    "agree",
    "same_outcome",
    "DEFAULT_BLOCK",
    "HierarchicalAllGather",
    "HierarchicalGroups",
    "QuantizedAllGather",
    "QuantizedReduceScatter",
    "QuantizedTensor",
    "Quantizer",
    "all_gather_coalesced",
    "compressed_all_reduce",
    "compressed_numel",
    "compressed_wire_bytes",
    "data_parallel_group",
    "dequantize_blockwise",
    "get_quantizer",
    "hierarchical_groups",
    "quantize_blockwise",
    "reduce_scatter_coalesced",
    "register_quantizer",
    "CollectiveError",
    "CollectiveTimeout",
    "CommHandle",
    "CommRecord",
    "CommsLogger",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_uneven",
    "all_to_all_v",
    "exchange_split_sizes",
    "P2PError",
    "P2PHandle",
    "P2POp",
    "P2PTimeout",
    "batch_send_recv",
    "recv",
    "send",
]
