"""Reading and editing compiled stage-3 parameters outside the graphs: what ``zero_core.registry.UnitHolder`` asks.

Between uses a compiled stage-3 parameter holds no values: its unit lives as this rank's chunk in the store's
``param_shard``. Outside the graphs nothing gathers it, so every reader that reaches a parameter through
``zero_core.registry`` (``GatheredParameters``, ``gathered_for_compute``, DeepSpeed's ``ds_status``) asks the store
to gather the unit: :class:`OutsideGathers` all-gathers it into a new buffer (compute dtype), points the unit's
parameters at views of it, and on release points them back at their placeholder and drops its reference, so a
tensor a user kept from inside a block stays valid memory (DeepSpeed's freed partitions behave the same way).

A placeholder is what the parameter holds at rest: a 0-element tensor after each optimizer step and before the
first forward (``rest``; reading it gives an empty tensor, never freed memory, as eager stage 3), and, from a
compiled forward until the next step, a tensor of the full shape over an empty storage (``shaped``: Dynamo and
AOTAutograd trace the shapes and the backward graphs take the same placeholders).
"""

from __future__ import annotations

import warnings

import torch

from zero_comm import all_gather_into_tensor
from zero_core.layout import Bucket
from zero_core.registry import ParamHandle
from zero_core.shard_state import ShardState, ZeroParamStatus


class OutsideGathers:
    """Base of ``zero_compile.core.CompiledParamStore``: the units gathered outside the graphs, and the
    parameters' placeholders (see the module docstring). Every gather is collective (one all-gather per unit).
    Reads the stored chunks through the store's ``shard_values(g)``.

    Args:
        flat_groups: the layout; group: the data-parallel process group;
        param_dtype / compute_dtype: the stored chunks' dtype and the dtype parameters are read in.

    Attributes:
        shaped: whether the parameters now hold full-shaped placeholders (a compiled forward ran since the last
            step) rather than 0-element ones.
    """

    def __init__(self, *, flat_groups, group, param_dtype: torch.dtype, compute_dtype: torch.dtype):
        self.flat_groups, self.group = flat_groups, group
        self.param_dtype, self.compute_dtype = param_dtype, compute_dtype
        self.shaped = False
        self._gathered: dict[Bucket, torch.Tensor] = {}  # unit -> its full buffer while gathered outside the graphs
        self._held: dict[Bucket, int] = {}  # unit -> blocks holding it (they nest)

    # -- placeholders
    def _placeholder(self, s, device) -> torch.Tensor:
        if self.shaped:
            t = torch.empty(s.shape, dtype=self.compute_dtype, device=device)
            t.untyped_storage().resize_(0)  # Dynamo traces its shape; nothing reads it
            return t
        return torch.empty(0, dtype=self.compute_dtype, device=device)

    def _point_at_placeholders(self) -> None:
        for g in self.flat_groups:
            for b in g.buckets:
                if b not in self._gathered:
                    for s in b.slots:
                        s.param.data = self._placeholder(s, g.device)

    def shape_for_graphs(self) -> None:
        """Before a compiled forward: parameters not gathered outside take full-shaped placeholders."""
        if not self.shaped:
            self.shaped = True
            self._point_at_placeholders()

    def to_rest(self) -> None:
        """After a step (or a load): parameters not gathered outside take 0-element placeholders."""
        self.shaped = False
        self._point_at_placeholders()

    def released_names(self) -> dict[int, str]:
        """``id(param)`` -> name of every parameter holding only its placeholder now."""
        return {id(s.param): s.name for g in self.flat_groups for b in g.buckets if b not in self._gathered
                for s in b.slots if s.numel > 0}  # fmt: skip

    def empty_released(self, module, state_dict, prefix, local_metadata) -> None:
        """``module.state_dict()`` post-hook: an entry of a parameter holding only its placeholder becomes a
        0-element tensor (never a view of an empty storage), with a warning naming the way to its value."""
        names = self.released_names()
        found = [k for k, v in state_dict.items() if isinstance(v, torch.Tensor) and k.startswith(prefix)
                 and v.numel() > 0 and v.untyped_storage().nbytes() == 0]  # fmt: skip
        for k in found:
            state_dict[k] = state_dict[k].new_empty(0)
        if found or any(k[len(prefix) :] in names.values() for k in state_dict):
            warnings.warn(
                f"compiled stage 3: state_dict() holds released parameters as empty tensors (e.g. "
                f"{(found or sorted(names.values()))[0]!r}); use GatheredParameters, "
                "engine._zero3_consolidated_16bit_state_dict() or save_16bit_model for their values",
                stacklevel=2,
            )

    # -- zero_core.registry.UnitHolder
    def state_of(self, b: Bucket) -> ShardState:
        """GATHERED while a block outside the graphs holds ``b`` gathered, else SHARDED."""
        return ShardState.GATHERED if b in self._gathered else ShardState.SHARDED

    @torch.no_grad()
    def gather(self, b: Bucket) -> None:
        """All-gather ``b`` into a new buffer and point its parameters at it (collective)."""
        if b in self._gathered:
            return
        g = b.group
        full = torch.empty(b.padded_numel, dtype=self.param_dtype, device=g.device)
        chunk = self.shard_values(g)[b.shard_slice()].contiguous()
        all_gather_into_tensor(full, chunk, self.group)
        full = full.to(self.compute_dtype)
        self._gathered[b] = full
        for s in b.slots:
            s.param.data = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)

    def gather_exact(self, b: Bucket) -> None:
        """:meth:`gather` (always a plain all-gather of the stored values)."""
        self.gather(b)

    def release(self, b: Bucket, *, keep_views: bool = True) -> None:
        """Point ``b``'s parameters back at their placeholders and drop the buffer unless a block holds it; the
        buffer is never freed under a view (``keep_views`` is always true here)."""
        if self._held.get(b, 0) or b not in self._gathered:
            return
        del self._gathered[b]
        for s in b.slots:
            s.param.data = self._placeholder(s, b.group.device)

    def hold(self, b: Bucket) -> None:
        self._held[b] = self._held.get(b, 0) + 1

    def unhold(self, b: Bucket) -> None:
        left = self._held.get(b, 0) - 1
        if left > 0:
            self._held[b] = left
        else:
            self._held.pop(b, None)

    def full_of(self, b: Bucket) -> torch.Tensor:
        """``b``'s gathered buffer (``padded_numel`` elements, compute dtype). Raises KeyError when not gathered."""
        return self._gathered[b]

    @torch.no_grad()
    def write_shard(self, b: Bucket, chunk: torch.Tensor) -> None:
        """Store ``chunk`` (``b.chunk`` elements) as this rank's stored chunk of ``b``."""
        self.shard_values(b.group)[b.shard_slice()].copy_(chunk.reshape(-1))

    def add_external(self, m: torch.nn.Module, b: Bucket) -> None:
        """Nothing: the compiled graphs gather whatever unit a forward reads."""

    def param_status(self, h: ParamHandle) -> ZeroParamStatus:
        """AVAILABLE while a block outside the graphs holds its unit gathered, else NOT_AVAILABLE."""
        return ZeroParamStatus.AVAILABLE if h.bucket in self._gathered else ZeroParamStatus.NOT_AVAILABLE

    def param_shape(self, h: ParamHandle) -> torch.Size:
        return h.slot.shape

    def param_partition(self, h: ParamHandle) -> torch.Tensor:
        """The elements of the parameter in this rank's stored chunk (a flat view; possibly empty)."""
        s, b = h.slot, h.bucket
        lo, hi = b.chunk_range(b.group.rank)
        a, e = max(lo, s.bucket_offset), min(hi, s.bucket_offset + s.numel)
        return self.shard_values(b.group)[b.shard_slice()][a - lo : max(a, e) - lo]
