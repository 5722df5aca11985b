"""The edges of ``save_checkpoint`` / ``load_checkpoint`` as DeepSpeed's engine defines them, checked before any work.

- ``save_checkpoint("")``: a ValueError naming ``save_dir`` (DeepSpeed would write into the current directory).
- Tags that differ between ranks: ``checkpoint.tag_validation`` says what happens (DeepSpeed's
  ``_checkpoint_tag_validation``: ``Warn`` warns, ``Fail`` raises, ``Ignore`` says nothing). Every rank then saves
  under rank 0's tag, so the checkpoint is whole (DeepSpeed lets each rank write under its own, leaving pieces in
  several folders).
- ``load_checkpoint(dir)`` without a tag where ``dir/latest`` is missing on every rank: a warning and ``(None, None)``,
  as DeepSpeed (a script that resumes at start-up runs on its first launch). Missing on some ranks only: the load's
  error, raised on every rank.
- ``checkpoint.load_universal: true``: without a tag the tag comes from ``dir/latest_universal`` (DeepSpeed's), or
  from ``dir/latest`` where only that exists (zero's checkpoints load at any rank count and stage); a ValueError on
  every rank when neither exists, as DeepSpeed's.
"""

from __future__ import annotations

import os
import warnings

import torch.distributed as dist

from zero_comm.objects import all_gather_object


def checked_save_dir(save_dir: str | os.PathLike) -> str:
    """``save_dir`` as a string. Raises ValueError when it is empty."""
    path = os.fspath(save_dir)
    if not path:
        raise ValueError("save_checkpoint: save_dir is empty; pass the folder the checkpoint goes to (nothing was "
                         "written)")  # fmt: skip
    return path


def agreed_tag(tag: str, policy: str, group) -> str:
    """Rank 0's ``tag`` on every rank of ``group`` (collective when it has several ranks).

    ``policy``: ``checkpoint.tag_validation`` (any case). Raises ValueError on every rank under ``Fail`` when the
    ranks' tags differ, naming each rank's tag.
    """
    if group is None or not dist.is_initialized() or group.size() == 1:
        return tag
    tags = all_gather_object(tag, group)
    if len(set(tags)) == 1:
        return tag
    listed = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    mode = policy.lower()
    if mode == "fail":
        raise ValueError(f"save_checkpoint: the ranks passed different tags ({listed}) and checkpoint.tag_validation "
                         "is 'Fail'; pass one tag on every rank")  # fmt: skip
    if mode == "warn":
        warnings.warn(f"save_checkpoint: the ranks passed different tags ({listed}); every rank saves under rank "
                      f"0's {tags[0]!r} (checkpoint.tag_validation 'Warn')", stacklevel=3)  # fmt: skip
    return tags[0]


def latest_is_missing(load_dir: str | os.PathLike, tag: str | None, group=None) -> bool:
    """True, with DeepSpeed's warning, when no ``tag`` is given and ``load_dir/latest`` is missing on every rank.

    Collective over ``group`` when it has several ranks: where some ranks find ``latest`` and others do not, this
    returns False so the load goes on and the missing file is the error every rank raises (a rank returning
    ``(None, None)`` alone would leave the others waiting in the load).
    """
    if tag is not None:
        return False
    latest = os.path.join(os.fspath(load_dir), "latest")
    missing = not os.path.isfile(latest)
    if group is not None and dist.is_initialized() and group.size() > 1:
        missing = all(all_gather_object(missing, group))
    if not missing:
        return False
    universal = os.path.isfile(os.path.join(os.fspath(load_dir), "latest_universal"))
    hint = "; it holds latest_universal: set checkpoint.load_universal: true to load that universal checkpoint"
    warnings.warn(f"load_checkpoint: no checkpoint to load: {latest} is missing (pass tag= to load a named one"
                  f"{hint if universal else ''}); returning (None, None) as DeepSpeed does", stacklevel=3)  # fmt: skip
    return True


def universal_tag(load_dir: str | os.PathLike, group=None) -> str | None:
    """The tag ``checkpoint.load_universal`` loads: the one in ``load_dir/latest_universal`` (DeepSpeed's pointer,
    written by ``ds_to_universal``); None where only ``latest`` exists, whose checkpoint then loads (zero's own
    checkpoints reshard onto any rank count and stage, so they serve as universal ones).

    Collective over ``group`` when it has several ranks. Raises ValueError on every rank, as DeepSpeed (``Invalid
    for universal checkpoint: ... does not exist``), when some rank finds neither file, or the ranks disagree.
    """
    root = os.fspath(load_dir)
    path = os.path.join(root, "latest_universal")
    tag = None
    if os.path.isfile(path):
        with open(path) as f:
            tag = f.read().strip()
    seen = [(tag, os.path.isfile(os.path.join(root, "latest")))]
    if group is not None and dist.is_initialized() and group.size() > 1:
        seen = all_gather_object(seen[0], group)
    if any(t is None and not has_latest for t, has_latest in seen) or len({t for t, _ in seen}) > 1:
        found = ", ".join(f"rank {r}: {t!r}" for r, (t, _) in enumerate(seen))
        raise ValueError(f"Invalid for universal checkpoint: {path} does not exist on every rank, nor a 'latest' "
                         f"beside it (checkpoint.load_universal is true; latest_universal tags: {found})")  # fmt: skip
    return tag
