"""Graph passes of one signature ``(gm, ctx) -> gm`` and the runner that composes them (see ``base``)."""

from zero_compile.passes.base import (
    Pass,
    PassContext,
    PassError,
    Schedule,
    check_contracts,
    passes_for_step,
    run_passes,
)
from zero_compile.passes.list_schedule import LIST_SCHEDULE, make_list_schedule
from zero_compile.passes.prefetch import PREFETCH
from zero_compile.passes.unshard import SELECTIVE_UNSHARD
from zero_compile.passes.zero1 import ZERO1, make_zero1
from zero_compile.passes.zero3 import ZERO3

__all__ = [
    "LIST_SCHEDULE",
    "PREFETCH",
    "SELECTIVE_UNSHARD",
    "ZERO1",
    "ZERO3",
    "Pass",
    "PassContext",
    "PassError",
    "Schedule",
    "check_contracts",
    "make_list_schedule",
    "make_zero1",
    "passes_for_step",
    "run_passes",
]
