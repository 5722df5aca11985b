"""DeepSpeed 0.19.8's ZeRO-optimizer names that integrations read on ``engine.optimizer`` beyond the loss-scale ones
(:mod:`zero.engine.loss_scale`): ``optimizer`` (the wrapped torch optimizer), ``refresh_fp32_params``,
``offload_states`` and ``reload_states``.

zero's ``engine.optimizer`` is the torch optimizer the runtime steps, whose class gains these names
(:func:`zero.engine.loss_scale.expose_loss_scale`); they act on the runtime and the engine's
:class:`~zero.engine.offload_states.StateOffload`, which the engine hands over with :func:`expose_offload`.
"""

from __future__ import annotations

import torch

from zero.engine.offload_states import OffloadDeviceEnum, StateOffload


class ZeroOptimizerNames:
    """Mixed into the optimizer's class; reads ``_zero_scale_source`` (the runtime) and ``_zero_state_offload``."""

    _zero_scale_source: object
    _zero_state_offload: StateOffload | None = None

    def __getattr__(self, name: str):
        # DeepSpeed's ZeRO optimizer wraps the torch one as `.optimizer` (`engine.optimizer.optimizer.state`): zero's
        # is the torch optimizer itself. An optimizer with an `optimizer` attribute of its own keeps it.
        if name == "optimizer":
            return self
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @torch.no_grad()
    def refresh_fp32_params(self) -> None:
        """Copy the model's 16-bit parameter values into the fp32 master weights (after editing the parameters
        in place), as DeepSpeed's. Collective: every rank calls it. Stage 3's parameters are this rank's shards."""
        runtime = self._zero_scale_source
        shards = runtime.shards()
        for i, g in enumerate(runtime.flat_groups):
            if runtime.master.master_shard(g) is not None:
                shards[i] = runtime.params.shard_values(g).to(shards[i].dtype)
        runtime.load_master_shards(shards)

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:  # fmt: skip
        """DeepSpeed's ZeRO optimizer ``offload_states``: the engine's :meth:`~zero.engine.Engine.offload_states`
        without the engine's checks (``include`` as there; ``device`` cpu)."""
        self._zero_state_offload.offload(include, OffloadDeviceEnum(getattr(device, "value", device)), pin_memory,
                                         non_blocking)  # fmt: skip

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what :meth:`offload_states` moved."""
        self._zero_state_offload.reload(non_blocking)


def expose_offload(optimizer: torch.optim.Optimizer, offload: StateOffload) -> None:
    """Give ``optimizer`` (already passed through ``expose_loss_scale``) the engine's state offload."""
    optimizer._zero_state_offload = offload
