"""``unwrap_model_for_generation`` (DeepSpeed 0.19.8's ``deepspeed.zero`` / ``deepspeed.runtime.zero.stage3``)."""

from __future__ import annotations

import contextlib

from zero.partitioning.gathered import GatheredParameters


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """Gather every parameter of ``model`` (the engine, as DeepSpeed takes it) once for the whole block, so that
    generation's many forwards run on full weights; yields ``model``. Collective: every rank enters.

    DeepSpeed also removes its stage-3 module hooks inside and registers them again on exit; zero's store leaves
    alone the units a ``GatheredParameters`` block holds, so its hooks stay. At stages 0-2 nothing is partitioned
    and the block only yields (DeepSpeed's version is for stage 3 only).
    """
    with GatheredParameters(list(model.parameters())):
        yield model
