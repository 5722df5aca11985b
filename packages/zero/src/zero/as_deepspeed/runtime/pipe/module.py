"""``deepspeed.runtime.pipe.module``: zero_parallel's pipeline module and layer specs."""

from zero_parallel.pipe import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec"]
