"""``deepspeed.runtime.pipe.engine``: zero's pipeline engine."""

from zero.engine.pipeline import PipelineEngine
from zero_parallel.pipe import PipelineError

__all__ = ["PipelineEngine", "PipelineError"]
