"""Interim `zero_optimization` model, used only while zero_core does not yet export ``ZeroConfig``.

zero_core owns this section; as soon as ``zero_core.ZeroConfig`` exists, config/model.py embeds it instead and this
file is unused. It accepts only the keys the plain-torch stage-0 path can honour.
"""

from __future__ import annotations

import pydantic
from pydantic import Field


class InterimZeroConfig(pydantic.BaseModel):
    """`zero_optimization` subset: stage (0-3) and the bucket sizes (elements, positive integers)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    stage: int = Field(default=0, ge=0, le=3)
    reduce_bucket_size: int = Field(default=500_000_000, gt=0)
    allgather_bucket_size: int = Field(default=500_000_000, gt=0)
    overlap_comm: bool = False
    contiguous_gradients: bool = True
