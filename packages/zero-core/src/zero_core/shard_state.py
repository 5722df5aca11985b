"""A stage-3 unit's state and the phases of a step: shared by the store (``zero_core.stage3``) and what reads its
units from outside (``GatheredParameters``, the ``ds_status`` readout), without importing the store."""

from __future__ import annotations

import enum

FORWARD, BACKWARD, STEP = 0, 1, 2
"""The phase a gather happens in (its ranks' agreement compares it)."""
PHASE_NAMES = ("forward", "backward", "step")
"""Each phase's name, indexed by the phase, for messages."""


class ShardState(enum.Enum):
    """Whether a unit's full parameters are materialised (``Stage3.state_of``)."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
