"""MuonClip under an engine: after each optimizer step, QK-clip on the fp32 master weights (``zero.optim.qk_clip``).

The engine's runtime steps Muon on pieces of the flat master shards, so ``Muon.step()`` cannot scale whole rows
itself; the engine calls :meth:`EngineQKClip.after_step` once the step has returned: the observed per-head maxima
are maximised over the data-parallel ranks (one small all-reduce per step), then each rank scales its pieces of the
clipped rows (``zero.engine.param_access.MasterRowScaler``) and, when a head was clipped, the model's parameters
are refreshed from the edited masters (collective, only on such steps).
"""

from __future__ import annotations

import torch

from zero.engine.param_access import MasterRowScaler
from zero.optim.muon import Muon
from zero.optim.qk_clip import QKClip
from zero_comm import all_reduce


class EngineQKClip:
    """The engine's side of a Muon optimizer built with ``qk_clip_threshold``."""

    def __init__(self, runtime, clip: QKClip):
        self.runtime = runtime
        self.clip = clip
        self.clipped = 0  # heads clipped by the last step (0 when none or the step was skipped)

    @classmethod
    def maybe(cls, runtime) -> EngineQKClip | None:
        """The clip of ``runtime``'s optimizer when it is a Muon with ``qk_clip_threshold`` (its ``step()`` then
        leaves the clip to the engine), else None."""
        opt = runtime.optimizer
        if not isinstance(opt, Muon) or opt.qk_clip is None:
            return None
        opt.hand_clip_to_engine()
        return cls(runtime, opt.qk_clip)

    def after_step(self, stepped: bool) -> int:
        """Clip after an applied step (a skipped one, e.g. fp16 overflow, only forgets the observations); returns
        the heads clipped. Collective: every rank calls it after every step."""
        if not stepped:
            self.clip.observed.clear()
            self.clipped = 0
            return 0
        rt = self.runtime

        def agree(t: torch.Tensor) -> None:
            if rt.world > 1:
                on_device = t.to(rt.device)  # NCCL reduces device tensors; gloo any
                all_reduce(on_device, rt.group, op="max")
                t.copy_(on_device.cpu())

        scaler = MasterRowScaler()
        self.clipped = self.clip.apply(scaler, agree)
        scaler.finish()
        return self.clipped
