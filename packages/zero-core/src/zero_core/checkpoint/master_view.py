"""The optimizer as checkpoints see it: one flat master shard per trainable flat group, whatever the master store.

``save``/``load`` read ``optimizer.param_groups``, ``optimizer.state.get(master)``, ``state_dict()`` and call
``load_state_dict()``; a :class:`zero_core.master.MasterStore` (device, host or NVMe; any per-parameter layout it
uses inside) answers through ``master_shard`` / ``state_shard`` / ``load_state_shard`` / ``clear_state`` in the
shard layout, so the checkpoint format does not depend on where the state lives.
"""

from __future__ import annotations

from typing import Any

# Param-group keys that are optimizer state, not hyper-parameters: DeepSpeed's and apex's FusedAdam count ``step``
# per group (added by the first step). A load replaces them with the saved group's, absent included.
GROUP_STATE_KEYS = ("step",)


class _StateView:
    """``optimizer.state`` keyed by master shard tensors (read, ``pop`` to clear)."""

    def __init__(self, view: MasterOptimizerView):
        self._view = view

    def _group(self, master):
        for g in self._view.trainable():
            if self._view.store.master_shard(g) is master:
                return g
        return None

    def get(self, master, default=None):
        g = self._group(master)
        state = self._view.store.state_shard(g) if g is not None else None
        return state if state else default

    def pop(self, master, default=None):
        g = self._group(master)
        if g is None:
            return default
        state = dict(self._view.store.state_shard(g))
        self._view.store.clear_state(g)
        return state


class MasterOptimizerView:
    """Duck-typed ``torch.optim.Optimizer`` for checkpointing a ``ZeroRuntime`` through its master store."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.store = runtime.master
        self.state = _StateView(self)

    def trainable(self) -> list:
        """Trainable flat groups, ordered by optimizer param group then flat-group index (the position order)."""
        groups = [g for g in self.runtime.flat_groups if g.group_index is not None]
        return sorted(groups, key=lambda g: (g.group_index, g.index))

    def hyper_groups(self) -> list[dict[str, Any]]:
        """The param groups' hyper-parameters without ``params`` (reads no master shard: a store on NVMe would
        read each whole shard back for ``param_groups``)."""
        return [{k: v for k, v in pg.items() if k != "params"} for pg in self.store.param_groups]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        out = []
        for i, pg in enumerate(self.store.param_groups):
            params = [self.store.master_shard(g) for g in self.trainable() if g.group_index == i]
            out.append({**{k: v for k, v in pg.items() if k != "params"}, "params": params})
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"state": position -> state, "param_groups": [hyper-parameters, "params": positions]}``."""
        position, groups, state = 0, [], {}
        for i, pg in enumerate(self.store.param_groups):
            mine = [g for g in self.trainable() if g.group_index == i]
            groups.append({**{k: v for k, v in pg.items() if k != "params"},
                           "params": list(range(position, position + len(mine)))})  # fmt: skip
            for g in mine:
                st = self.store.state_shard(g)
                if st:
                    state[position] = dict(st)
                position += 1
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hyper-parameters into the store's param groups; each position's state into its flat group (absent:
        cleared). A group's :data:`GROUP_STATE_KEYS` the saved group lacks are removed (the saved run had not
        stepped that group), as ``torch.optim.Optimizer.load_state_dict`` replaces whole groups.

        Raises:
            ValueError: the number of param groups differs.
        """
        saved = state_dict["param_groups"]
        if len(saved) != len(self.store.param_groups):
            raise ValueError(
                f"optimizer state has {len(saved)} param groups, the optimizer {len(self.store.param_groups)}"
            )
        for pg, sg in zip(self.store.param_groups, saved):
            pg.update({k: v for k, v in sg.items() if k != "params"})
            for k in GROUP_STATE_KEYS:
                if k not in sg:
                    pg.pop(k, None)
        for position, g in enumerate(self.trainable()):
            st = state_dict["state"].get(position)
            if st:
                self.store.load_state_shard(g, st)
            else:
                self.store.clear_state(g)
