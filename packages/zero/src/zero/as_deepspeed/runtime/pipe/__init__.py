"""``deepspeed.runtime.pipe``: ``module``, ``topology``, ``schedule`` and ``engine`` (zero_parallel's pipeline and
zero's pipeline engine)."""

from zero.as_deepspeed.runtime.pipe import engine, module, schedule, topology
from zero_parallel.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "ProcessTopology", "TiedLayerSpec", "engine", "module", "schedule",
           "topology"]  # fmt: skip
