"""The errors a stage-3 store raises when ranks part ways: different gathers, or some ranks missing from one."""

from __future__ import annotations

from zero_comm import CollectiveTimeout


class RankDivergenceError(RuntimeError):
    """Ranks issued different stage-3 gathers: they ran different modules or a different number of times."""


class MissingRanksError(RankDivergenceError, CollectiveTimeout):
    """Some ranks never joined a stage-3 collective this rank waited in until the process group's timeout.

    Also a :class:`~zero_comm.CollectiveTimeout` (and ``TimeoutError``), so handlers of gather timeouts see it.

    Attributes: ``collective`` (what this rank waited in), ``unit`` (the unit's index, or None), ``params`` (the
    unit's parameter names), ``missing`` (global ranks with no note for the same collective, ascending),
    ``elsewhere`` (global rank -> what that rank waits in instead), ``waited`` (seconds), ``rank``, ``group_size``.
    """

    def __init__(self, message: str, *, collective: str, unit: int | None, params: list[str], missing: list[int],
                 elsewhere: dict[int, str], waited: float, rank: int, group_size: int):  # fmt: skip
        RuntimeError.__init__(self, message)
        self.collective, self.unit, self.params = collective, unit, params
        self.missing, self.elsewhere, self.waited = missing, elsewhere, waited
        self.rank, self.group_size, self.sizes, self.notice = rank, group_size, "", None

    def __reduce__(self):
        """Picklable (exceptions are rebuilt from ``args`` by default, which this signature does not take)."""
        kwargs = {k: getattr(self, k) for k in ("collective", "unit", "params", "missing", "elsewhere", "waited",
                                                 "rank", "group_size")}  # fmt: skip
        return (_rebuild, (type(self), str(self), kwargs))


def _rebuild(cls: type, message: str, kwargs: dict) -> MissingRanksError:
    return cls(message, **kwargs)
