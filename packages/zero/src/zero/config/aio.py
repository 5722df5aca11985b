"""`aio`: DeepSpeed's async I/O section, read by NVMe offload (``zero_kernels.aio``), same keys and defaults."""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import Field, PositiveInt


class AioSection(pydantic.BaseModel):
    """`aio`: how NVMe swap files are read and written.

    ``block_size`` (bytes per request chunk, a multiple of 4096), ``queue_depth`` (requests in flight per thread),
    ``intra_op_parallelism`` (threads splitting one request; ``thread_count`` is its older name), ``single_submit``
    and ``overlap_events`` (accepted: zero's thread-pool engine has nothing to batch or poll), ``use_gds`` (GPU
    Direct Storage: false only).
    """

    model_config = pydantic.ConfigDict(extra="forbid")
    block_size: PositiveInt = Field(1_048_576, multiple_of=4096)
    queue_depth: PositiveInt = 8
    intra_op_parallelism: PositiveInt = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: Literal[False] = False

    @pydantic.model_validator(mode="before")
    @classmethod
    def _thread_count(cls, data: Any) -> Any:
        if isinstance(data, dict) and "thread_count" in data:
            data = dict(data)
            old = data.pop("thread_count")
            if data.setdefault("intra_op_parallelism", old) != old:
                raise ValueError("thread_count and intra_op_parallelism are the same key (old and new name) and "
                                 "disagree; keep intra_op_parallelism")  # fmt: skip
        return data

    def settings(self):
        """This section as ``zero_kernels.aio.AioSettings``."""
        from zero_kernels.aio import AioSettings

        return AioSettings(block_size=self.block_size, queue_depth=self.queue_depth,
                           thread_count=self.intra_op_parallelism, single_submit=self.single_submit,
                           overlap_events=self.overlap_events)  # fmt: skip
