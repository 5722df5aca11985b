"""The default :class:`zero_core.master.MasterStore`: master shards and optimizer state on the parameters' device,
stepped by the user's ``torch.optim.Optimizer``.

Memory (ZeRO formula, arXiv 1910.02054 section 5): when the stored parameter shard is contiguous and already in
the master dtype (fp32 at stage 0, fp32 stages 1/2 with one bucket per flat group, fp32 stage 3) the master *is*
that shard (no second copy); otherwise one fp32 copy of this rank's shard per flat group.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.layout import Bucket, FlatGroup
from zero_core.master import StepDecision


class DeviceMaster:
    """Master shards on device, stepped by ``rt.optimizer``; see :mod:`zero_core.master` for the protocol."""

    def __init__(self):
        self.rt = None
        self.param_groups: list[dict[str, Any]] = []
        self._original: list[list[torch.Tensor]] = []

    def attach(self, rt) -> None:
        """Build one master shard per trainable flat group, carry over any optimizer state the optimizer already
        holds (sharded like the parameters), and make the optimizer's param groups hold the masters.

        Raises:
            ValueError: the optimizer holds state for only some parameters of a group (names the group).
        """
        self.rt = rt
        self.optimizer = rt.optimizer
        self.param_groups = rt.optimizer.param_groups
        self._original = [list(pg["params"]) for pg in self.param_groups]
        md = rt.precision.master_dtype
        for g in rt.flat_groups:
            if g.group_index is None:
                continue
            view = rt.params.shard_view(g)
            if view is not None and view.dtype == md:
                g.master = torch.nn.Parameter(view)  # the stored shard is the master: no second copy
            else:
                g.master = torch.nn.Parameter(rt.params.shard_values(g).to(md, copy=True))
        self._shard_optimizer_state()
        for g in rt.flat_groups:
            if g.group_index is not None:
                self.param_groups[g.group_index]["params"] = [g.master]

    def _shard_optimizer_state(self) -> None:
        """Carry state the optimizer already holds (Adagrad creates it in its constructor; a run may also wrap an
        optimizer that has stepped) over to the master shards: per-element tensors are flattened and sharded like
        the parameters, scalars (``step``) are taken as they are."""
        old = self.optimizer.state
        if not old:
            return
        new = {}
        for g in self.rt.flat_groups:
            if g.group_index is None:
                continue
            per = [old.get(s.param) for s in g.slots]
            if all(st is None for st in per):
                continue
            if any(st is None for st in per) or any(st.keys() != per[0].keys() for st in per):
                raise ValueError(f"optimizer param group {g.group_index}: some parameters have optimizer state and "
                                 "others do not, or with different keys; cannot shard it")  # fmt: skip
            state = {}
            for k, v in per[0].items():
                if isinstance(v, torch.Tensor) and all(st[k].shape == s.shape for st, s in zip(per, g.slots)):
                    flat = torch.cat([st[k].detach().reshape(-1) for st in per]).to(self.rt.precision.master_dtype)
                    state[k] = g.shard_from_full(flat)
                else:
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v
            new[g.master] = state
        old.clear()
        old.update(new)

    def on_grad_ready(self, bucket: Bucket, grad_shard: torch.Tensor, boundary: bool | None) -> None:
        """Nothing to do: the gradient shard already lives where the optimizer reads it."""

    def step(self, decision: StepDecision) -> bool:
        """Scale the gradient shards by ``decision.coef`` and run ``optimizer.step()``; False on overflow."""
        if decision.overflow:
            return False
        trainable = [g for g in self.rt.flat_groups if g.group_index is not None]
        for g in trainable:
            if decision.coef != 1.0:
                g.grad.mul_(decision.coef)
            g.master.grad = g.grad if g.grad.dtype == g.master.dtype else g.grad.to(g.master.dtype)
        self.optimizer.step()
        for g in trainable:
            g.master.grad = None
        return True

    @torch.no_grad()
    def write_params(self, bucket: Bucket, dst: torch.Tensor) -> None:
        """This rank's chunk of ``bucket`` from the master into ``dst`` (cast); nothing when ``dst`` is the master."""
        src = bucket.group.master.detach()[bucket.shard_offset : bucket.shard_offset + bucket.chunk]
        if src.data_ptr() != dst.data_ptr() or src.dtype != dst.dtype:
            dst.copy_(src)

    def master_shard(self, g: FlatGroup) -> torch.Tensor | None:
        """The master shard (the tensor the optimizer steps), None for a frozen group."""
        return g.master

    def state_shard(self, g: FlatGroup) -> dict[str, Any]:
        """The optimizer state of ``g``'s master (shard-shaped tensors, scalars such as ``step``); live dict."""
        return self.optimizer.state.get(g.master, {}) if g.master is not None else {}

    @torch.no_grad()
    def load_master_shard(self, g: FlatGroup, shard: torch.Tensor) -> None:
        """Copy ``shard`` (``g.shard_numel`` elements) into the master."""
        g.master.detach().copy_(shard.reshape(-1))

    def load_state_shard(self, g: FlatGroup, state: dict[str, Any]) -> None:
        """Replace ``g``'s optimizer state; floating tensors other than ``step`` are cast to the master's dtype and
        device (as ``Optimizer.load_state_dict`` does)."""
        out = {}
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and k != "step" and v.is_floating_point():
                v = v.to(dtype=g.master.dtype, device=g.master.device)
            out[k] = v
        self.optimizer.state[g.master] = out

    def clear_state(self, g: FlatGroup) -> None:
        """Drop ``g``'s optimizer state (as a freshly built optimizer)."""
        self.optimizer.state.pop(g.master, None)

    def close(self) -> None:
        """Give the optimizer its original parameters back, with no state (the sharded state cannot apply)."""
        if self.rt is None:
            return
        for g in self.rt.flat_groups:
            if g.master is not None:
                self.optimizer.state.pop(g.master, None)
                g.master = None
        for pg, params in zip(self.param_groups, self._original):
            pg["params"] = params
        self._original = []
        self.rt = None
