"""DeepSpeed's checkpoint files read without unpickling anything but an explicit allow-list.

DeepSpeed writes its checkpoints with ``torch.save`` (pickles). They are read here with
``torch.load(weights_only=True)``, which builds only tensors, containers and torch's own safe types, plus the few
DeepSpeed objects a ZeRO checkpoint of DeepSpeed 0.19.x holds, each mapped to a stand-in that keeps the pickled
attributes and runs no DeepSpeed code:

* ``deepspeed.runtime.zero.config.ZeroStageEnum`` -> the stage as an ``int``;
* ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler`` and
  ``deepspeed.utils.tensor_fragment.fragment_address`` -> :class:`PickledRecord` (their attributes in ``state``).

Any other global in a file is refused with :class:`~zero_core.checkpoint.storage.CheckpointError` naming the file and
the type; nothing else is constructed or imported. DeepSpeed itself need not be installed.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from zero_core.checkpoint.storage import CheckpointError


class PickledRecord:
    """A DeepSpeed object of a checkpoint file, kept as its pickled attributes (never constructed).

    Attributes:
        state: the attributes the pickle holds (``LossScaler``: ``cur_scale``, ``dynamic``, ...;
            ``fragment_address``: ``numel``, ``start``).
    """

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        # pickle's BUILD: a dict of attributes, or (dict, slots) for classes with __slots__
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = dict(state) if isinstance(state, dict) else {"value": state}


ALLOWED = (
    (int, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (PickledRecord, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (PickledRecord, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (PickledRecord, "deepspeed.utils.tensor_fragment.fragment_address"),
)

_REFUSED = re.compile(r"GLOBAL ([\w.<>]+)")


def load_deepspeed_file(path: Path, expect: type | tuple[type, ...] = dict) -> Any:
    """What DeepSpeed ``torch.save``-d to ``path`` (a dict, or whatever ``expect`` names), on CPU, through
    ``torch.load(weights_only=True)`` with :data:`ALLOWED` as the only extra globals.

    Raises:
        CheckpointError: the file is missing or unreadable, is not an ``expect``, or holds a type outside the
            allow-list (the message names the file and the refused global).
    """
    try:
        with torch.serialization.safe_globals(list(ALLOWED)):
            # memory-mapped: a rank reading every rank's partitions copies only the ranges its own shard needs
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"DeepSpeed checkpoint file {path} is missing") from e
    except pickle.UnpicklingError as e:
        found = _REFUSED.search(str(e))
        what = f"the global {found.group(1)}" if found else f"an object torch refuses ({str(e).strip()[-200:]})"
        raise CheckpointError(f"DeepSpeed checkpoint file {path} holds {what}, which zero does not unpickle: only "
                              "tensors, containers and DeepSpeed's loss scaler, stage enum and fragment addresses are "
                              "read") from e  # fmt: skip
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {type(e).__name__}: {e}") from e
    if not isinstance(obj, expect):
        wanted = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise CheckpointError(f"DeepSpeed checkpoint file {path} holds a {type(obj).__name__}, expected a {wanted}")
    return obj
