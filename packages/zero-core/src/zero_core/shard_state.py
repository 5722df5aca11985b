"""A stage-3 unit's state, a partitioned parameter's status and the phases of a step: shared by the store
(``zero_core.stage3``) and what reads its units from outside (``GatheredParameters``, the ``ds_status`` readout),
without importing the store."""

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


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter's full value is materialised now (DeepSpeed's enum of this name, read as
    ``param.ds_status``): ``AVAILABLE`` (gathered: inside its module's forward or a ``GatheredParameters`` block),
    ``NOT_AVAILABLE`` (only this rank's partition is held), ``INFLIGHT`` (an all-gather is on its way)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3
