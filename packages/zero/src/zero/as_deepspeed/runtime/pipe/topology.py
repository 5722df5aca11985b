"""``deepspeed.runtime.pipe.topology``: zero_parallel's process topologies and pipeline grid."""

from zero_parallel.pipe import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid", "ProcessTopology"]
