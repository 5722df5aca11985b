"""``ZeroRuntime``: ZeRO stages 0-3 around a user's module and ``torch.optim.Optimizer`` (arXiv 1910.02054)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor, all_reduce, broadcast
from zero_core import stage3
from zero_core.config import ZeroConfig
from zero_core.layout import FlatGroup, build_flat_group, split_by_size
from zero_core.memory import model_state_bytes
from zero_core.param_sync import ParamSync
from zero_core.precision import PrecisionPolicy, StaticLossScaler
from zero_core.reducer import GradReducer
from zero_core.zero_init import unpartition
from zero_core.zeropp import ZeroPP, check_zeropp


@dataclass(frozen=True)
class StepResult:
    """What ``step()`` did. ``grad_norm``: full-model pre-clip gradient norm (unscaled; identical on every rank;
    inf/nan on overflow)."""

    stepped: bool
    overflow: bool
    grad_norm: float


class ZeroRuntime:
    """Shard a module's training state over a process group at ZeRO stage 0, 1, 2 or 3.

    Args:
        module: the model; its parameters are re-laid into flat buffers (each ``param.data`` becomes a view of its
            bucket's buffer: the only way the forward can read flat storage without copies, as Megatron does).
        optimizer: any ``torch.optim.Optimizer`` built over ``module``'s parameters; afterwards its param groups
            hold this rank's fp32 master shard (one tensor per group), hyper-parameters untouched, and any state it
            already had is sharded the same way.
        config: the ``zero_optimization`` section (stage, buckets, stage-3 knobs, ZeRO++: ``zero_core.zeropp``).
        precision: dtypes for storage/communication, compute, reduction, master and accumulation.
        group: the data-parallel process group (None: WORLD).
        gradient_clipping: max global gradient norm (0: off), ``torch.nn.utils.clip_grad_norm_`` semantics.
        loss_scaler: e.g. ``DynamicLossScaler`` for fp16; None: a static scale of 1 (non-finite steps still skip).

    Initial weights are broadcast from the group's rank 0. Gradients are the sum over ``backward`` calls of the
    rank-average of each micro-batch's gradient: divide the loss by the number of micro-batches for a mean (the
    engine does). Unused parameters get a zero gradient.

    Raises:
        ValueError: an optimizer parameter is not in ``module``, a trainable parameter is in no optimizer group,
            or the optimizer holds state for only some parameters of a group, or ``zero_hpz_partition_size``
            does not divide the world size (raised before any communication).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig | None = None,
        precision: PrecisionPolicy | None = None,
        group=None,
        gradient_clipping: float = 0.0,
        loss_scaler=None,
    ):
        self.module = module
        self.optimizer = optimizer
        self.config = config or ZeroConfig()
        self.precision = precision or PrecisionPolicy()
        self.group = group or dist.group.WORLD
        self.world = self.group.size()
        self.rank = dist.get_rank(self.group)
        self.stage = self.config.stage
        self.gradient_clipping = float(gradient_clipping)
        self.loss_scaler = loss_scaler or StaticLossScaler()
        self.overflow = False
        self.skipped_steps = 0
        if gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0, got {gradient_clipping}")
        check_zeropp(self.config, self.world)  # before any communication
        if self.stage < 3:
            for prm in module.parameters():
                unpartition(prm)  # built under zero_init but trained at a dense stage
        for prm in module.parameters():
            prm.grad = None  # gradients flow through the buckets; a stale .grad would be added in once
        first = next(iter(module.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.flat_groups: list[FlatGroup] = self._plan()
        self._params = {id(s.param): (g, s) for g in self.flat_groups for s in g.slots}
        self._sync = None
        self.zeropp = ZeroPP(self.config, self.group) if self.stage == 3 else None
        if self.stage == 3:
            self._stage3 = stage3.Stage3(self)
        else:
            self._stage3 = None
            self._materialize_dense()
            lazy = self.stage in (1, 2) and self.config.overlap
            self._sync = ParamSync(self.flat_groups, module, self.group, self.precision.param_dtype, lazy)
        self._shard_optimizer_state()
        for g in self.flat_groups:
            if g.group_index is not None:
                optimizer.param_groups[g.group_index]["params"] = [g.master]
        p = self.precision
        self.reducer = GradReducer(
            self.flat_groups, self.stage, self.group, (p.reduce, p.accum), self.config.overlap,
            on_bucket_done=self._stage3.on_grads_done if self._stage3 else None,
            reduce_scatter=self.zeropp.reduce_scatter if self.zeropp and self.zeropp.qgz else None,
        )  # fmt: skip

    # ---------------------------------------------------------------- layout
    def _plan(self) -> list[FlatGroup]:
        named = []
        for name, p in self.module.named_parameters():
            if p.is_floating_point():
                named.append((name, p))
            else:  # integer parameters (frozen by necessity) are left as they are, rank 0's values everywhere
                broadcast(p.data, dist.get_global_rank(self.group, 0), self.group)
        order = {id(p): i for i, (_, p) in enumerate(named)}
        key: dict[int, int | None] = {}
        for gi, pg in enumerate(self.optimizer.param_groups):
            for p in pg["params"]:
                if not p.is_floating_point():
                    continue  # dropped from the optimizer: it cannot be trained
                if id(p) not in order:
                    raise ValueError(f"optimizer param group {gi} holds a tensor of shape {tuple(p.shape)} that is "
                                     "not a parameter of the module")  # fmt: skip
                key[id(p)] = gi if p.requires_grad else None
        for name, p in named:
            if p.requires_grad and id(p) not in key:
                raise ValueError(f"trainable parameter {name!r} is in no optimizer param group; add it to the "
                                 "optimizer or set requires_grad=False")  # fmt: skip
            key.setdefault(id(p), None)
        keys = list(range(len(self.optimizer.param_groups))) + [None]
        by_key = {k: [(n, p) for n, p in named if key[id(p)] == k] for k in keys}
        if self.stage == 3:
            plans, self.unit_owner = stage3.plan_units(self.module, key, self.config, keys)
        else:
            plans = {k: (split_by_size(v, self.config.reduce_bucket_size), None) for k, v in by_key.items()}
        groups, first = [], 0
        for k in keys:
            buckets, persistent = plans[k]
            if k is None and not buckets:
                continue
            parts = self.world if (self.stage == 3 or (k is not None and self.stage >= 1)) else 1
            persistent = persistent or [True] * len(buckets)
            fg = build_flat_group(len(groups), k, self.precision.param_dtype, parts, self.rank if parts > 1 else 0,
                                  buckets, persistent, first, order)  # fmt: skip
            first += len(buckets)
            groups.append(fg)
        return groups

    def _materialize_dense(self) -> None:
        """Stages 0-2: one contiguous compute-dtype buffer per flat group, broadcast from rank 0; params view it."""
        p = self.precision
        for g in self.flat_groups:
            full = torch.zeros(g.padded_numel, dtype=p.compute, device=g.device)
            pos = 0
            for b in g.buckets:
                b.full = full[pos : pos + b.padded_numel]
                for s in b.slots:
                    src = s.param.detach().reshape(-1).to(p.param_dtype).to(p.compute)
                    b.full[s.bucket_offset : s.bucket_offset + s.numel].copy_(src)
                pos += b.padded_numel
            broadcast(full, dist.get_global_rank(self.group, 0), self.group)
            for b in g.buckets:
                for s in b.slots:
                    s.param.data = b.full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)
            if g.group_index is None:
                continue
            same = p.param_dtype == p.compute == p.master_dtype
            if same and self.stage == 0:  # stage 0 fp32: the optimizer steps the model's own buffer, no second copy
                g.master = torch.nn.Parameter(full)
            elif same and len(g.buckets) == 1:
                # fp32 stages 1/2: the master shard is this rank's chunk of the model's own buffer (ZeRO formula:
                # no separate master copy); the optimizer updates it in place, the all-gather fills the rest.
                # Several buckets would make a rank's chunks non-contiguous, so they keep a copy (see README).
                g.master = torch.nn.Parameter(g.buckets[0].full[slice(*g.buckets[0].chunk_range(g.rank))])
            else:
                shard = [b.full[slice(*b.chunk_range(g.rank))] for b in g.buckets]
                empty = torch.zeros(0, dtype=p.master_dtype, device=g.device)
                data = torch.cat(shard).to(p.master_dtype) if shard else empty
                g.master = torch.nn.Parameter(data)

    def _shard_optimizer_state(self) -> None:
        """Carry state the optimizer already holds (Adagrad creates it in its constructor; a run may also wrap an
        optimizer that has stepped) over to the master shards: per-element tensors are flattened and sharded like
        the parameters, scalars (``step``) are taken as they are."""
        old = self.optimizer.state
        if not old:
            return
        new = {}
        for g in self.flat_groups:
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
                    flat = torch.cat([st[k].detach().reshape(-1) for st in per]).to(self.precision.master_dtype)
                    state[k] = g.shard_from_full(flat)
                else:
                    state[k] = v.clone() if isinstance(v, torch.Tensor) else v
            new[g.master] = state
        old.clear()
        old.update(new)

    # ---------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, *, is_boundary: bool | None = None, retain_graph: bool = False) -> None:
        """Backward of ``loss * loss_scale``; gradients accumulate until ``step()``/``zero_grad()``.

        ``is_boundary``: True marks the last micro-batch before ``step()`` so stages 0/1 reduce during this backward
        (overlapped); otherwise they reduce at ``step()``. Stages 2/3 reduce every backward. Never drops gradients.
        """
        self.wait_for_params()
        self.reducer.begin_backward(is_boundary)
        if self._stage3:
            self._stage3.begin_backward()
        scale = self.loss_scaler.scale
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        if self._stage3:
            self._stage3.end_backward()
        self.reducer.end_backward()

    def _grad_norm(self) -> float:
        trainable = [g for g in self.flat_groups if g.group_index is not None]
        # per-shard norms in the accumulation dtype (as clip_grad_norm_ does), squared and summed in fp64
        norms = [torch.linalg.vector_norm(g.grad, dtype=torch.float32).double() for g in trainable]
        total = torch.stack(norms).pow(2).sum().reshape(1) if norms else torch.zeros(1, dtype=torch.float64)
        if any(g.partitions > 1 for g in trainable):
            all_reduce(total, self.group, op="sum")
        value = total.item()
        return math.sqrt(value) / self.loss_scaler.scale if math.isfinite(value) else float("nan")

    def step(self) -> StepResult:
        """Reduce what is pending, compute the global norm, skip on overflow, clip, step the shard, refresh params.

        On a non-finite norm (all ranks agree: it comes from one all-reduce) parameters and optimizer state are
        left bitwise unchanged, the loss scaler backs off, ``skipped_steps`` grows and ``overflow`` is True.
        Gradients are cleared either way.
        """
        self.wait_for_params()
        self.reducer.finish_round()
        norm = self._grad_norm()
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            self.loss_scaler.update(True)
            self.skipped_steps += 1
            self.zero_grad()
            return StepResult(False, True, norm)
        coef = 1.0 / self.loss_scaler.scale
        if self.gradient_clipping > 0:
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        for g in self.flat_groups:
            if g.group_index is None:
                continue
            if coef != 1.0:
                g.grad.mul_(coef)
            g.master.grad = g.grad if g.grad.dtype == g.master.dtype else g.grad.to(g.master.dtype)
        self.optimizer.step()
        for g in self.flat_groups:
            if g.master is not None:
                g.master.grad = None
        self._refresh_params()
        self.loss_scaler.update(False)
        self.zero_grad()
        return StepResult(True, False, norm)

    def _refresh_params(self) -> None:
        """Bring the model's parameters up to date with the master shards (all-gather per bucket)."""
        if self._stage3:
            self._stage3.refresh()
        else:
            self._sync.refresh()

    def wait_for_params(self) -> None:
        """Stages 1/2 with ``overlap_comm``: finish the parameter all-gathers ``step()`` left in flight (forward
        hooks, ``backward``, ``step`` and the accessors do this themselves; call it before reading parameters
        outside those). No-op otherwise."""
        if self._sync is not None:
            self._sync.wait()

    def zero_grad(self) -> None:
        """Clear accumulated gradients (the optimizer's ``zero_grad`` has nothing to clear: ``.grad`` is transient)."""
        self.reducer.zero()

    # ---------------------------------------------------------------- accessors
    def _gather_shard(self, g: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
        """Unpadded flat vector from every rank's ``shard`` (collective when partitioned)."""
        if g.partitions == 1:
            return g.full_from_shards([shard.detach()])
        out = torch.empty(g.shard_numel * g.partitions, dtype=shard.dtype, device=shard.device)
        all_gather_into_tensor(out, shard.detach().contiguous(), self.group)
        return g.full_from_shards(list(out.view(g.partitions, g.shard_numel).unbind(0)))

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Name -> full fp32 parameter (new tensors, logical shapes): masters for trainable parameters, the stored
        values for frozen ones. Collective: every rank must call it."""
        self.wait_for_params()
        out = {}
        for g in self.flat_groups:
            if g.master is not None:
                flat = self._gather_shard(g, g.master)
            elif self._stage3:
                flat = self._gather_shard(g, g.param_shard)
            else:
                flat = torch.cat([b.full[: b.numel] for b in g.buckets]) if g.buckets else torch.zeros(0)
            for s in g.slots:
                out[s.name] = flat[s.offset : s.offset + s.numel].view(s.shape).float().clone()
        return out

    def full_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The full accumulated gradient of ``param`` (fp32, logical shape; unscaled by nothing: it is what the
        optimizer would see before clipping and loss-scale division), like DeepSpeed's ``safe_get_full_grad``.
        Finishes pending reductions first. None for frozen parameters. Collective: every rank must call it."""
        if id(param) not in self._params:
            raise ValueError(f"full_grad: tensor of shape {tuple(param.shape)} is not a parameter of this runtime")
        g, s = self._params[id(param)]
        if g.group_index is None or not param.requires_grad:
            return None
        self.reducer.finish_round()
        flat = self._gather_shard(g, g.grad)
        return flat[s.offset : s.offset + s.numel].view(s.shape).float().clone()

    def shards(self) -> list[torch.Tensor]:
        """Per flat group: the fp32 master shard (trainable) or the stored parameter shard (frozen): what a
        checkpoint saves and ``load_master_shards`` takes back."""
        self.wait_for_params()
        out = []
        for g in self.flat_groups:
            if g.master is not None:
                out.append(g.master.detach())
            elif self._stage3:
                out.append(g.param_shard)
            else:
                out.append(torch.cat([b.full[: b.numel] for b in g.buckets]) if g.buckets else torch.zeros(0))
        return out

    @torch.no_grad()
    def load_master_shards(self, shards: list[torch.Tensor]) -> None:
        """Copy this rank's shards (as ``shards()`` returns, one per flat group; reshard with ``FlatGroup``
        ``full_from_shards``/``shard_from_full``) in and refresh the model's parameters. Collective.

        Raises ValueError naming the flat group when a count or size does not match.
        """
        if len(shards) != len(self.flat_groups):
            raise ValueError(f"load_master_shards: expected {len(self.flat_groups)} shards, got {len(shards)}")
        for g, (dst, src) in zip(self.flat_groups, zip(self.shards(), shards)):
            if src.numel() != dst.numel():
                raise ValueError(f"load_master_shards: flat group {g.index} ({g.names[:3]}...) expects "
                                 f"{dst.numel()} elements, got {src.numel()}")  # fmt: skip
            if g.master is None and not self._stage3:
                for b in g.buckets:
                    b.full[: b.numel].copy_(src[b.start : b.start + b.numel])
            else:
                dst.copy_(src.reshape(-1))
        if self._stage3:
            self._stage3.refresh()
        else:
            self._refresh_params()

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of params, grads, master weights and optimizer state (see ``zero_core.memory``)."""
        return model_state_bytes(self)
