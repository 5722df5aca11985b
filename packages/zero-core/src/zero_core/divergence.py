"""Stage-3 rank-divergence checks: ranks that run different modules must fail together, never hang or abort.

Units differ in size and gloo aborts the process when two ranks' all-gathers differ in size, so ranks compare what
they are about to gather through a fixed-size (4 x int64) all-gather on a *side* gloo group of the same ranks: a
check never pairs with a unit's all-gather. Each message is ``(kind, unit, phase, order hash)``:

- ``GATHER``: this rank is about to gather ``unit`` (every gather of the recording pass, and of a pass that left
  the recorded order);
- ``END``: this rank's forward is over (once per step, from ``Stage3.begin_backward``); ``unit`` is the number of
  forward gathers and ``hash`` a running hash of their (unit, phase) sequence. This one is issued asynchronously and
  compared by ``settle()``, which the store calls before its next collective on the ranks (a backward gather, the
  first gradient reduction, or the end of backward): a rank that finishes its forward first runs into backward
  instead of waiting at a barrier for the slower one (the ranks' forwards differ by 10-40 ms on a shared 2-core
  machine, and that wait was paid every step);
- ``TIMEOUT``: this rank's gather of ``unit`` timed out while it followed the record, so a peer may be waiting
  here after departing from it.

Every rank raises :class:`RankDivergenceError` naming each rank's message when they differ. The side group's
timeout is twice the main group's, so a departed rank is still waiting when its peers' gathers time out and join.
A check or gather that times out because some ranks run no forward at all (``generate()`` on rank 0 only) raises
:class:`~zero_core.stage3_errors.MissingRanksError` naming them (``missing_ranks.py``): after the main group's
timeout for a gather (plus at most that again to meet a departed peer), twice it for a check, then a grace period.
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from zero_comm import CollectiveTimeout, all_gather_into_tensor
from zero_core.missing_ranks import grace_seconds, missing_ranks_error, post_note
from zero_core.shard_state import PHASE_NAMES
from zero_core.stage3_errors import MissingRanksError, RankDivergenceError

GATHER, END, TIMEOUT = 0, 1, 2
_MOD = (1 << 61) - 1  # Mersenne prime: the running hash stays an int64


def _timeout(group) -> timedelta:
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - backends without options: torch's default gloo timeout
        return timedelta(minutes=30)


# main group -> its side group: one per group however many runtimes wrap it, freed with the main group
_SIDE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def companion_group(group, cache: weakref.WeakKeyDictionary, *, backend: str, timeout: timedelta):
    """A process group of ``group``'s ranks with ``backend`` and ``timeout``, created on first use (collective
    over those ranks only) and kept in ``cache`` (main group -> companion), so however many runtimes wrap ``group``
    they share one.

    The cache holds the main group weakly: the companion is freed with it (at ``destroy_process_group`` when
    nothing else holds the main group), on every rank at the same point. Freed later, at some rank's garbage
    collection, a companion with an operation still in flight (a rank that raised between issuing an order check
    and settling it) would wait in its destructor until every peer had freed its copy too."""
    side = cache.get(group)
    if side is not None and side in dist.distributed_c10d._world.pg_map:
        return side
    side = dist.new_group(dist.get_process_group_ranks(group), backend=backend, timeout=timeout,
                          use_local_synchronization=True)  # fmt: skip
    cache[group] = side
    return side


def side_group(group):
    """The side gloo group of ``group``'s ranks (created on first use, collective over those ranks only)."""
    return companion_group(group, _SIDE, backend="gloo", timeout=2 * _timeout(group))


class DivergenceCheck:
    """The side group and the running hash of one stage-3 store's forward gathers."""

    def __init__(self, group, world: int, rank: int):
        self.world, self.rank = world, rank
        self.group = group
        self.timeout = _timeout(group).total_seconds() if world > 1 else 0.0  # the main group's, in seconds
        self.side = side_group(group) if world > 1 else None
        self.count, self.hash = 0, 0
        self.pending: tuple | None = None  # (handle, received rows) of an order check issued, not yet compared

    def note(self, b, phase: int) -> None:
        """Add a forward gather of unit ``b`` to the running hash."""
        self.count += 1
        self.hash = (self.hash * 1_000_003 + b.index * 4 + phase + 1) % _MOD

    def agree(self, b, phase: int) -> None:
        """Before gathering ``b``: every rank must be gathering the same unit in the same phase.

        Raises:
            RankDivergenceError: on every rank, naming each rank's unit and phase.
            MissingRanksError: some ranks never joined the check (they are not running this forward), naming them.
        """
        try:
            self._compare((GATHER, b.index, phase, 0), b)
        except CollectiveTimeout as exc:
            raise self._missing(b, phase, 2 * self.timeout, grace_seconds(self.timeout), in_check=True) from exc

    def agree_order(self) -> None:
        """Forward is over on this rank: issue the check that every rank gathered the same units in the same order
        (asynchronous: :meth:`settle` compares). Resets the running hash.

        Raises:
            RankDivergenceError: on every rank, from an earlier order check still unsettled that found ranks apart.
        """
        self.settle()
        mine = (END, self.count, 0, self.hash)
        self.count, self.hash = 0, 0
        if self.side is None:
            return
        every = torch.empty(4 * self.world, dtype=torch.int64)
        handle = all_gather_into_tensor(every, torch.tensor(mine, dtype=torch.int64), self.side, async_op=True)
        self.pending = (handle, every)

    def settle(self) -> None:
        """Wait for the order check :meth:`agree_order` issued, if any, and compare (cheap when none is pending).

        Raises:
            RankDivergenceError: on every rank, naming how many units each rank gathered and each order hash.
            MissingRanksError: a peer never ended its forward within the side group's timeout, naming it.
        """
        if self.pending is None:
            return
        (handle, every), self.pending = self.pending, None
        try:
            handle.wait()
        except CollectiveTimeout as exc:
            raise self._missing(None, 0, 2 * self.timeout, grace_seconds(self.timeout)) from exc
        self._judge(every, None)

    def after_timeout(self, b, phase: int, check_peers: bool) -> MissingRanksError:
        """This rank's gather of ``b`` in ``phase`` timed out: the error to raise, naming the ranks that never joined.

        With ``check_peers`` (this rank was following the record, so a peer that departed from it may wait in a
        check), first meet such a peer on the side group, for at most :func:`grace_seconds` of the timeout.

        Raises:
            RankDivergenceError: when a peer is waiting in a check (it ran something else at this point).
        """
        post_note(self.group, b.index, [s.name for s in b.slots], phase)
        if check_peers and self.side is not None:
            self.settle()  # checks meet on the side group in issue order: an order check in flight comes first
            every = torch.empty(4 * self.world, dtype=torch.int64)
            mine = torch.tensor((TIMEOUT, b.index, phase, 0), dtype=torch.int64)
            handle = all_gather_into_tensor(every, mine, self.side, async_op=True)
            try:
                handle.wait(grace_seconds(self.timeout))
            except CollectiveTimeout:  # no peer is in a check: the peers that joined posted their notes before
                return self._missing(b, phase, self.timeout, 0.0, posted=True)
            self._judge(every, b)
        return self._missing(b, phase, self.timeout, grace_seconds(self.timeout), posted=True)

    def _missing(self, b, phase: int, waited: float, grace: float, posted: bool = False,
                 in_check: bool = False) -> MissingRanksError:  # fmt: skip
        unit, params = (b.index, [s.name for s in b.slots]) if b is not None else (None, [])
        if not posted:
            post_note(self.group, unit, params, phase)
        return missing_ranks_error(self.group, unit, params, phase, waited, grace, in_check)

    def _compare(self, mine: tuple, b) -> None:
        if self.side is None:
            return
        self.settle()  # checks meet on the side group in issue order: an order check in flight comes first
        every = torch.empty(4 * self.world, dtype=torch.int64)
        all_gather_into_tensor(every, torch.tensor(mine, dtype=torch.int64), self.side)
        self._judge(every, b)

    def _judge(self, every: torch.Tensor, b) -> None:
        rows = every.view(self.world, 4).tolist()
        if rows.count(rows[0]) == len(rows):
            return
        seen = ", ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(rows))
        where = f"; unit {b.index} starts with {b.slots[0].name!r}" if b is not None else ""
        raise RankDivergenceError(
            f"stage 3: ranks gathered different parameter units at the same point ({seen}{where}). Every rank must "
            "run the same modules the same number of times; make data-dependent loop counts agree first, e.g. "
            "all_reduce(max)."
        )

    def close(self) -> None:
        """Drop the side group (not destroyed: destroying a group is collective over every rank in torch). An order
        check still in flight is dropped uncompared: every rank issued it, so it completes in the background (a
        ``close`` after a failure must not wait out the side group's timeout)."""
        self.pending = None
        self.side = None


def _describe(row: list) -> str:
    kind, unit, phase, h = row
    if kind == END:
        return f"forward over after {unit} unit gathers (order hash {h:x})"
    what = "unit" if kind == GATHER else "timed out gathering unit"
    return f"{what} {unit} in {PHASE_NAMES[phase]}"
