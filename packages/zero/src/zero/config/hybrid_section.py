"""`hybrid_engine`: DeepSpeed 0.19.8's switch between training and generation (RLHF rollouts) on one engine.

Keys and defaults as DeepSpeed's ``HybridEngineConfig``: ``enabled`` (false), ``max_out_tokens`` (512, > 0),
``inference_tp_size`` (1), ``release_inference_cache`` (false), ``pin_parameters`` (true),
``tp_gather_partition_size`` (8), ``enable_cuda_graph`` (false). With ``enabled``, ``initialize()`` returns a
:class:`~zero.engine.hybrid.HybridEngine` (its ``generate`` documents what each key does in zero). DeepSpeed accepts
every ZeRO stage here, and so does zero.
"""

from __future__ import annotations

import pydantic
from pydantic import Field, PositiveInt


class HybridEngineSection(pydantic.BaseModel):
    """`hybrid_engine` (DeepSpeed's keys and defaults; unknown keys refused naming them).

    ``inference_tp_size`` must divide the world size (checked by the engine at construction, every rank).
    """

    model_config = pydantic.ConfigDict(extra="forbid")

    enabled: bool = False
    max_out_tokens: int = Field(512, gt=0)
    inference_tp_size: PositiveInt = 1
    release_inference_cache: bool = False
    pin_parameters: bool = True
    tp_gather_partition_size: PositiveInt = 8
    enable_cuda_graph: bool = False
