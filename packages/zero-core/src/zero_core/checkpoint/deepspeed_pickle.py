"""``torch.save`` of DeepSpeed's checkpoint dicts with the few DeepSpeed objects its loader indexes, without DeepSpeed.

DeepSpeed 0.19.x's ZeRO optimizer files hold three of its own types, and its loader uses them as objects:
``loss_scaler`` (a ``deepspeed.runtime.fp16.loss_scaler.LossScaler``, kept as the optimizer's scaler at stage 3),
``zero_stage`` (a ``deepspeed.runtime.zero.config.ZeroStageEnum``) and ``param_slice_mappings`` (values of
``deepspeed.utils.tensor_fragment.fragment_address``, read as ``.start`` / ``.numel`` by ``ds_to_universal``).
A :class:`DeepSpeedObject` is written under DeepSpeed's class name with the opcodes DeepSpeed's own pickles use
(``NEWOBJ`` + ``BUILD`` for the scaler and the fragment address, ``REDUCE`` for the enum), so DeepSpeed's
``torch.load`` builds its real classes, and zero's reader (:mod:`zero_core.checkpoint.deepspeed_files`) reads them
through its allow-list. Nothing of DeepSpeed is imported here.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch

LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler.LossScaler"
ZERO_STAGE = "deepspeed.runtime.zero.config.ZeroStageEnum"
FRAGMENT_ADDRESS = "deepspeed.utils.tensor_fragment.fragment_address"


class DeepSpeedObject:
    """One DeepSpeed object to pickle: class ``qualname`` (``module.Class``), called with ``args`` (``REDUCE``) when
    ``state`` is None, else made with ``NEWOBJ`` and given ``state`` as its attributes (``BUILD``)."""

    def __init__(self, qualname: str, args: tuple = (), state: dict[str, Any] | None = None):
        self.qualname, self.args, self.state = qualname, args, state


def loss_scaler(scale: float = 1.0) -> DeepSpeedObject:
    """DeepSpeed's static ``LossScaler`` at ``scale`` (what fp32 and bf16 runs hold)."""
    return DeepSpeedObject(LOSS_SCALER, state={"cur_scale": float(scale), "dynamic": False})


def zero_stage(stage: int) -> DeepSpeedObject:
    """DeepSpeed's ``ZeroStageEnum`` member of ``stage`` (1-3)."""
    return DeepSpeedObject(ZERO_STAGE, args=(int(stage),))


def fragment_address(numel: int, start: int) -> DeepSpeedObject:
    """DeepSpeed's ``fragment_address``: ``numel`` elements of a parameter at ``start`` of a rank's partition."""
    return DeepSpeedObject(FRAGMENT_ADDRESS, state={"numel": int(numel), "start": int(start)})


class _Pickler(pickle._Pickler):  # the Python pickler: the C one looks every class up by importing its module
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if type(obj) is not DeepSpeedObject:
            super().save(obj, save_persistent_id)
            return
        module, name = obj.qualname.rsplit(".", 1)
        self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode())
        self.save(tuple(obj.args))
        if obj.state is None:
            self.write(pickle.REDUCE)
            return
        self.write(pickle.NEWOBJ)
        self.save(obj.state)
        self.write(pickle.BUILD)


_PICKLE_MODULE = types.SimpleNamespace(__name__="pickle", Pickler=_Pickler, Unpickler=pickle.Unpickler)


def save_deepspeed_file(obj: Any, path: Path) -> None:
    """``torch.save(obj, path)`` (protocol 2, zip format, as DeepSpeed writes) with :class:`DeepSpeedObject` values
    pickled as DeepSpeed's classes."""
    torch.save(obj, path, pickle_module=_PICKLE_MODULE, pickle_protocol=2)
