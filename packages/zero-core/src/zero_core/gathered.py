"""``GatheredParameters``: read or edit full parameters outside forward (DeepSpeed's ``zero.GatheredParameters``).

Works for parameters of a stage-3 ``ZeroRuntime`` and for parameters partitioned by ``zero_init`` before any
runtime exists; other parameters are already whole and the context does nothing for them. Collective: every rank
enters and leaves with the same parameters.

* ``modifier_rank=r``: on exit the values of rank r of the parameters' process group (the global rank when that
  group is the world; DeepSpeed's conversion) are broadcast and become the new shards (and fp32 master weights),
  so edits made by rank r persist on every rank. With ZeRO++ the gather is exact (never qwZ), and on exit
  hpZ's secondary shards are rebuilt and persistent units re-gathered through qwZ/hpZ.
* Module forwards inside the block (generation on a gathered model) leave its units alone: no gather, release,
  recorded order or divergence check, so ranks may run different numbers of forwards there.
* Inside a backward, a trainable unit is left gathered at exit until its gradients are in (a custom autograd
  function's backward that gathers a weight returns its full-shape gradient after the block).
* ``modifier_rank=None``: read-only. If any rank changed a value in place, every rank raises ``RuntimeError`` on
  exit (the check is one all-reduce, so no rank is left waiting) and the values are restored.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Protocol

import torch
import torch.distributed as dist

from zero_comm import GroupOperationError, agree, all_reduce, broadcast
from zero_core import registry
from zero_core.layout import Bucket, FlatGroup
from zero_core.partition_records import gather_partitioned, partitioned_record
from zero_core.registry import UnitHolder
from zero_core.shard_state import ShardState


class MasterWriter(Protocol):
    """What a block with a ``modifier_rank`` asks the runtime owning an edited stage-3 unit (``ZeroRuntime``)."""

    def write_master(self, g: FlatGroup, where: slice, values: torch.Tensor) -> None:
        """``values`` become the fp32 master of trainable flat group ``g`` at ``where`` (this rank's shard)."""
        ...


class GatheredParameters:
    """Context manager over ``params`` (a Parameter or an iterable of them); see the module docstring.

    Raises:
        RuntimeError: on exit, when ``modifier_rank`` is None and some rank modified a gathered value.
    """

    def __init__(self, params, modifier_rank: int | None = None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self.units: list[tuple[UnitHolder, Bucket]] = []  # stage-3 units holding some of params
        self.owners: dict[int, MasterWriter] = {}  # id(store) -> the runtime it partitions for (edits reach its master)
        self.loose: list = []  # (parameter, zero_init partition): partitioned at construction, in no runtime
        self.snapshots: list[torch.Tensor] = []

    def __enter__(self):
        if not self.enabled:
            return self
        for p in self.params:
            found = registry.lookup(p)  # the stage-3 store and unit holding p, if any
            if found is not None and found.store is not None:
                if found.unit not in self.units:
                    self.units.append(found.unit)
                    self.owners[id(found.store)] = found.owner
            elif partitioned_record(p) is not None:
                self.loose.append((p, partitioned_record(p)))
        for st, b in self.units:
            st.gather_exact(b)  # its values may be written back: never a qwZ copy
            st.hold(b)  # forwards inside the block leave it alone (generation)
        for p, _ in self.loose:
            p.data = gather_partitioned(p).clone()
        if self.modifier_rank is None:
            self.snapshots = [t.clone() for t in self._tensors()]
        return self

    def _tensors(self):
        return [st.full_of(b) for st, b in self.units] + [p.data for p, _ in self.loose]

    def __exit__(self, *exc):
        group = self.units[0][0].group if self.units else (self.loose[0][1].group if self.loose else None)
        if not self.enabled or group is None:
            return self._release(*exc)
        try:  # an error in the block on any rank is the same error on every rank
            agree("GatheredParameters", exc[1], group)
        except GroupOperationError as agreed:
            self._release(*exc)
            raise agreed from exc[1]
        return self._release(*exc)

    @torch.no_grad()
    def _release(self, *exc):
        if not self.enabled:
            return False
        group = self.units[0][0].group if self.units else (self.loose[0][1].group if self.loose else None)
        modified = False
        if group is not None and self.modifier_rank is not None:
            src = dist.get_global_rank(group, self.modifier_rank)  # a rank of the group (a data-parallel subgroup)
            for t in self._tensors():
                broadcast(t, src, group)
        elif group is not None:
            changed = any(not torch.equal(t, s) for t, s in zip(self._tensors(), self.snapshots))
            flag = torch.tensor([float(changed)], device=self._tensors()[0].device)
            all_reduce(flag, group, op="max")
            modified = bool(flag.item())
            if modified:
                for t, s in zip(self._tensors(), self.snapshots):
                    t.copy_(s)
        if self.modifier_rank is not None:
            for st in {id(st): st for st, _ in self.units}.values():
                st.before_write()  # no peer still reads the stored shards the write-back replaces
        for st, b in self.units:
            if self.modifier_rank is not None:
                _write_back(st, b, self.owners[id(st)])
            st.unhold(b)
            if not _gradient_pending(b):
                st.release(b, keep_views=True)  # a tensor kept from the block must not read freed memory
        if self.modifier_rank is not None:
            for st in {id(st): st for st, _ in self.units}.values():
                st.shards_edited()  # hpZ's secondary copy must see the edit
        for p, rec in self.loose:
            if self.modifier_rank is not None:
                flat = torch.zeros(rec.shard.numel() * rec.group.size(), dtype=rec.dtype, device=rec.shard.device)
                flat[: rec.numel] = p.data.reshape(-1)
                r = dist.get_rank(rec.group)
                rec.shard.copy_(flat[r * rec.shard.numel() : (r + 1) * rec.shard.numel()])
            p.data = torch.empty(0, dtype=rec.dtype, device=rec.shard.device)
        self.units, self.owners, self.loose, self.snapshots = [], {}, [], []
        if modified and exc[0] is None:
            raise RuntimeError(
                "GatheredParameters: parameters were modified in place without modifier_rank; the change was "
                "discarded on every rank. Pass modifier_rank=<rank whose values should persist> to keep edits."
            )
        return False


def _gradient_pending(b: Bucket) -> bool:
    """Whether unit ``b`` must stay gathered after the block: a block entered inside a backward over trainable
    parameters (a custom autograd function whose backward gathers a weight it reads directly, as TRL's fused LM head
    does) returns that weight's gradient, which autograd accumulates into the parameter after the block has ended
    and which must match the parameter's full shape then. The unit is released once its gradients are in
    (``on_grads_done``) or when the backward ends (``end_backward``), as a unit gathered by its module's backward."""
    in_backward = torch._C._current_graph_task_id() != -1
    return in_backward and b.group.group_index is not None  # trainable (a forward-only runtime has none)


def _write_back(st: UnitHolder, b: Bucket, owner: MasterWriter) -> None:
    """Gathered (edited) values of unit ``b`` become its stored shard and fp32 master shard."""
    g = b.group
    lo, hi = b.chunk_range(g.rank)
    chunk = st.full_of(b)[lo:hi]
    st.write_shard(b, chunk)
    if g.group_index is not None:  # trainable: the master (wherever it lives) takes the edit too
        owner.write_master(g, b.shard_slice(), chunk)


@contextmanager
def gathered_for_compute(params):
    """Hold the stage-3 units of ``params`` gathered for a computation inside forward or backward that calls their
    modules several times (sequence-tiled compute: ``zero_parallel.TiledMLP`` and its kin), so each unit is
    all-gathered once for the block instead of once per call; module forwards inside leave the held units alone.

    Unlike :class:`GatheredParameters` this is for the training passes themselves: the current phase's gather (qwZ
    when configured), no snapshot, no agreement on exit. A unit gathered on entry is released on exit; one already
    gathered (by an enclosing module, a prefetch or a near reuse) is left as it was. Parameters no stage-3 store
    holds are already whole and ignored. Collective: every rank enters with the same parameters in the same order.
    """
    entries = []
    for p in params:
        entry = registry.stage3_unit(p)
        if entry is not None and entry not in entries:
            entries.append(entry)
    ours = [(st, b) for st, b in entries if st.state_of(b) is ShardState.SHARDED]
    for st, b in entries:
        st.gather(b)
        st.hold(b)
    try:
        yield
    finally:
        for st, b in entries:
            st.unhold(b)
        for st, b in ours:
            st.release(b)
