"""Pipeline parallelism: DeepSpeed's ``PipelineModule`` / ``LayerSpec`` / ``TiedLayerSpec``, its process
topologies, its schedules as data (``TrainSchedule``: 1F1B; ``InferenceSchedule``; beyond DeepSpeed,
``InterleavedTrainSchedule``: Megatron's interleaved 1F1B over virtual stages; ``ZeroBubbleTrainSchedule``: ZB-H1,
backward split into input- and weight-gradient passes), ``decoder_layers``: a transformers decoder-only LM cut into
layers, and the stage executor that
runs a schedule with point-to-point transfers from zero_comm. The engine around a stage (optimizer, ZeRO over the
stage's data-parallel group) is the caller's, through :class:`StageTraining`.

Imports torch and zero_comm only.
"""

from zero_parallel.pipe.executor import StageExecutor, StageTraining
from zero_parallel.pipe.hf_split import DecoderLayerStage, causal_lm_loss, decoder_layers
from zero_parallel.pipe.interleaved import InterleavedInferenceSchedule, InterleavedTrainSchedule
from zero_parallel.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec, set_random_seed
from zero_parallel.pipe.partition import partition_balanced, partition_uniform
from zero_parallel.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)
from zero_parallel.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from zero_parallel.pipe.weight_grad import WeightGradStore
from zero_parallel.pipe.zero_bubble import BackwardInputPass, BackwardWeightPass, ZeroBubbleTrainSchedule

__all__ = [
    "BackwardInputPass",
    "BackwardPass",
    "BackwardWeightPass",
    "BufferOpInstruction",
    "DecoderLayerStage",
    "ForwardPass",
    "InferenceSchedule",
    "InterleavedInferenceSchedule",
    "InterleavedTrainSchedule",
    "LayerSpec",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeDataParallelTopology",
    "PipeInstruction",
    "PipeModelDataParallelTopology",
    "PipeSchedule",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "StageExecutor",
    "StageTraining",
    "TiedLayerSpec",
    "TrainSchedule",
    "WeightGradStore",
    "ZeroBubbleTrainSchedule",
    "causal_lm_loss",
    "decoder_layers",
    "partition_balanced",
    "partition_uniform",
    "set_random_seed",
]
