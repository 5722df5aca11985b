"""Naming the ranks that never joined a stage-3 gather, once the wait for them has timed out.

At stage 3 every rank holds a shard of every parameter, so a forward run on some ranks only (``generate()`` or an
evaluation under ``if rank == 0``) leaves those ranks waiting in an all-gather the others never enter. The backend
only says that the wait timed out. Each rank that times out in a stage-3 gather or divergence check posts a note to
the default process group's store (which unit, which phase, what it waited in); a rank with no note is in no stage-3
collective at all. Notes are written only on this failure path, so a step costs nothing extra. The error is raised
within the process group's timeout (``init_distributed(timeout=...)``, DeepSpeed's ``DEEPSPEED_TIMEOUT`` minutes, 10
by default) plus a grace period (:func:`grace_seconds`) in which the peers that did join post their notes.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from zero_core.shard_state import PHASE_NAMES
from zero_core.stage3_errors import MissingRanksError

_NOTE_KEY = "zero_core/stage3/timed_out/"
GRACE_CAP_S = 30.0
"""Longest wait, in seconds, for the notes of peers that joined the same collective and time out after this rank."""


def grace_seconds(timeout: float) -> float:
    """How long to wait for the notes of the peers that joined: the timeout itself, at most ``GRACE_CAP_S``."""
    return min(timeout, GRACE_CAP_S)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - without a store the error names no ranks
        return None


def _key(ranks: list[int], rank: int) -> str:
    return f"{_NOTE_KEY}{','.join(map(str, ranks))}/{rank}"


def _unit_text(unit: int | None, params: list[str], phase: int) -> str:
    if unit is None:
        return f"the end-of-forward order check ({PHASE_NAMES[phase]})"
    names = ", ".join(repr(n) for n in params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
    return f"the all-gather of parameter unit {unit} ({names}) in {PHASE_NAMES[phase]}"


def post_note(group, unit: int | None, params: list[str], phase: int) -> None:
    """Tell the peers that this rank timed out waiting in the stage-3 collective of ``unit`` (None: the order
    check) in ``phase``. Best effort: without a store nothing is posted."""
    store = _store()
    if store is None:
        return
    note = {"unit": unit, "phase": phase, "text": _unit_text(unit, params, phase)}
    try:
        store.set(_key(dist.get_process_group_ranks(group), dist.get_rank()), json.dumps(note))
    except Exception:  # noqa: BLE001 - the error is still raised, naming fewer ranks
        pass


def missing_ranks_error(group, unit: int | None, params: list[str], phase: int, waited: float, grace: float,
                        in_check: bool = False) -> MissingRanksError:  # fmt: skip
    """The error for this rank's timed-out wait in ``unit``'s collective (call :func:`post_note` first): waits up to
    ``grace`` seconds for every peer's note, then names the ranks with none for the same unit and phase.
    ``in_check``: the wait was the divergence check just before the unit's all-gather."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    store = _store()
    notes: dict[int, dict] = {}
    deadline = time.monotonic() + grace
    while store is not None:
        for r in ranks:
            if r not in notes and r != me:
                try:
                    if store.check([_key(ranks, r)]):
                        notes[r] = json.loads(store.get(_key(ranks, r)))
                except Exception:  # noqa: BLE001 - a peer's note that cannot be read counts as absent
                    pass
        if len(notes) == len(ranks) - 1 or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    joined = {r for r, n in notes.items() if n.get("unit") == unit and n.get("phase") == phase}
    missing = [r for r in ranks if r != me and r not in joined]
    elsewhere = {r: notes[r]["text"] for r in missing if r in notes}
    what = _unit_text(unit, params, phase)
    what = f"the rank check before {what}" if in_check and unit is not None else what
    return MissingRanksError(
        _message(me, what, missing, elsewhere, waited, store is not None), collective=what, unit=unit, params=params,
        missing=missing, elsewhere=elsewhere, waited=waited, rank=me, group_size=len(ranks),
    )  # fmt: skip


def _message(me: int, what: str, missing: list[int], elsewhere: dict[int, str], waited: float, known: bool) -> str:
    if missing:
        who = "; ".join(f"rank {r} waits in {elsewhere[r]} instead" if r in elsewhere else
                        f"rank {r} is in no stage-3 gather: it did not run this forward" for r in missing)  # fmt: skip
        head = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never joined it ({who})"
    else:
        head = "the ranks that did not join it are unknown" + ("" if known else " (no store to ask)")
    return (
        f"stage 3: rank {me} waited {waited:.1f} s in {what}, and {head}. At ZeRO-3 every rank holds a shard of "
        "every parameter, so every rank must run every forward: the usual cause is a forward or generate() run on "
        "some ranks only (e.g. under `if rank == 0`) or a different number of times per rank. Run it on every rank "
        "(transformers' generate(synced_gpus=True) keeps the ranks' generation steps together), or gather the whole "
        "model first with GatheredParameters (TRL's unwrap_model_for_generation). The wait follows the process "
        "group's timeout: init_distributed(timeout=...) or DEEPSPEED_TIMEOUT (minutes, default 10)."
    )
