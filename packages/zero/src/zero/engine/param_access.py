"""DeepSpeed's ``safe_get_*`` / ``safe_set_*`` (``deepspeed/utils/tensor_fragment.py``) on zero's flat shards.

DeepSpeed finds a parameter's shard through attributes it sets on the parameter; zero keeps that state in the
runtime, which claims its parameters in ``zero_core.registry`` when it is built and releases them when it is
closed (``engine.destroy()``): each function looks the parameter up there (O(1)). A parameter no live runtime
holds (never in an engine, or its engine destroyed) is the documented case below: ``safe_get_full_grad`` returns
its ``.grad``, every other function raises ValueError. "Full" means the whole logical tensor (collective: every
rank of the engine's group must call it, in the same order); "local" means this rank's piece of it: the elements
of the parameter's flat range that lie in this rank's shard, flat (1-D), possibly empty. Values are fp32 (master
weights, optimizer state) or the gradient accumulation dtype.
"""

from __future__ import annotations

import torch

from zero_comm import all_gather_into_tensor
from zero_core import ZeroRuntime, registry


def _locate(param: torch.Tensor, name: str):
    """``(runtime, flat_group, slot)`` holding ``param``. Raises ValueError when no live engine trains it."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{name}: param must be a torch.nn.Parameter, got {type(param).__name__}")
    found = registry.lookup(param)
    if found is None or not isinstance(found.owner, ZeroRuntime):
        raise ValueError(
            f"{name}: the parameter (shape {tuple(param.shape)}) belongs to no live zero engine; pass a "
            "parameter of engine.module (a destroyed engine's parameters are plain tensors)"
        )
    return found.owner, found.group, found.slot


def _full(rt, g, s, shard: torch.Tensor) -> torch.Tensor:
    """The parameter's full value (logical shape) from every rank's ``shard`` of flat group ``g`` (collective)."""
    shard = shard.detach().reshape(-1).contiguous()
    if g.partitions == 1:
        flat = g.full_from_shards([shard])
    else:
        out = torch.empty(shard.numel() * g.partitions, dtype=shard.dtype, device=shard.device)
        all_gather_into_tensor(out, shard, rt.group)
        flat = g.full_from_shards(list(out.view(g.partitions, -1).unbind(0)))
    return flat[s.offset : s.offset + s.numel].view(s.shape).clone()


def _pieces(g, s):
    """``(param_lo, param_hi, shard_lo)``: where this rank's shard holds elements of slot ``s`` (flat indices)."""
    for flat_lo, flat_hi, shard_lo in g.shard_ranges():
        lo, hi = max(flat_lo, s.offset), min(flat_hi, s.offset + s.numel)
        if hi > lo:
            yield lo - s.offset, hi - s.offset, shard_lo + (lo - flat_lo)


@torch.no_grad()
def _set_full(g, s, shard: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(s.shape):
        raise ValueError(f"{name}: value for {s.name!r} must have shape {tuple(s.shape)}, got {tuple(value.shape)}")
    flat = value.detach().reshape(-1)
    for p_lo, p_hi, sh_lo in _pieces(g, s):
        shard.view(-1)[sh_lo : sh_lo + p_hi - p_lo].copy_(flat[p_lo:p_hi])


def _local(g, s, shard: torch.Tensor) -> torch.Tensor:
    parts = [shard.detach().reshape(-1)[sh_lo : sh_lo + hi - lo] for lo, hi, sh_lo in _pieces(g, s)]
    return torch.cat(parts).clone() if parts else shard.new_empty(0)


@torch.no_grad()
def _set_local(g, s, shard: torch.Tensor, value: torch.Tensor, name: str) -> None:
    pieces = list(_pieces(g, s))
    expected = sum(hi - lo for lo, hi, _ in pieces)
    flat = value.detach().reshape(-1)
    if flat.numel() != expected:
        raise ValueError(f"{name}: this rank holds {expected} elements of {s.name!r}, got a value of {flat.numel()}")
    done = 0
    for lo, hi, sh_lo in pieces:
        shard.view(-1)[sh_lo : sh_lo + hi - lo].copy_(flat[done : done + hi - lo])
        done += hi - lo


def _master(rt, g, s) -> torch.Tensor | None:
    master = rt.master.master_shard(g)
    return master if master is not None and s.trainable else None


def _state_dict(rt, g, s, key: str, name: str) -> dict | None:
    """``g``'s optimizer state in the shard layout (a copy, from the runtime's master store), None when frozen.
    Raises KeyError when ``key`` is missing."""
    if _master(rt, g, s) is None:
        return None
    state = rt.master.state_shard(g)
    if key not in state:
        raise KeyError(f"{name}: optimizer state has no {key!r} for {s.name!r} (keys: {sorted(state)})")
    return state


def _state(rt, g, s, key: str, name: str) -> torch.Tensor | None:
    state = _state_dict(rt, g, s, key, name)
    return None if state is None else state[key]


def _grad(rt, g, s) -> torch.Tensor | None:
    if not s.trainable or g.group_index is None:
        return None
    return rt.grad_values(g)  # gradients still being reduced land first


def _refresh(rt, g=None, master: torch.Tensor | None = None) -> None:
    if master is not None:  # an offloaded store hands out a copy (NVMe, Twin-Flow): the edit goes back through it
        rt.master.load_master_shard(g, master.detach())
    rt.load_master_shards(rt.shards())  # the model's parameters follow the edited master shards (collective)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master value of ``param`` (logical shape); None for a frozen parameter. Collective."""
    rt, g, s = _locate(param, "safe_get_full_fp32_param")
    master = _master(rt, g, s)
    return None if master is None else _full(rt, g, s, master)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master value of ``param`` (full shape) and refresh the model's copies. Collective.

    Raises ValueError for a frozen parameter or a wrong shape."""
    rt, g, s = _locate(param, "safe_set_full_fp32_param")
    master = _master(rt, g, s)
    if master is None:
        raise ValueError(f"safe_set_full_fp32_param: {s.name!r} is frozen (no fp32 master weights)")
    rt.params.before_write()  # stage 3's master may be the stored shard that peers read (shared windows)
    _set_full(g, s, master.data, value.to(master.dtype), "safe_set_full_fp32_param")
    _refresh(rt, g, master)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``; None when frozen.
    A scalar state (``"step"``) is returned as stored. Raises KeyError for a missing key. Collective."""
    rt, g, s = _locate(param, "safe_get_full_optimizer_state")
    t = _state(rt, g, s, optim_state_key, "safe_get_full_optimizer_state")
    if t is None or t.dim() == 0:
        return t
    return _full(rt, g, s, t)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the full optimizer state ``optim_state_key`` of ``param`` (full shape). Raises KeyError / ValueError."""
    rt, g, s = _locate(param, "safe_set_full_optimizer_state")
    state = _state_dict(rt, g, s, optim_state_key, "safe_set_full_optimizer_state")
    if state is None:
        raise ValueError(f"safe_set_full_optimizer_state: {s.name!r} is frozen (no optimizer state)")
    t = state[optim_state_key]
    _set_full(g, s, t, value.to(t.dtype), "safe_set_full_optimizer_state")
    rt.master.load_state_shard(g, state)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full gradient of ``param`` reduced over ranks (mean of the ranks' gradients, summed over the
    micro-batches so far), in the accumulation dtype; None for a frozen parameter or before any backward.
    A parameter of no engine: its ``.grad``. Collective."""
    try:
        rt, g, s = _locate(param, "safe_get_full_grad")
    except ValueError:
        return param.grad
    grad = _grad(rt, g, s)
    return None if grad is None else _full(rt, g, s, grad)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite the reduced gradient of ``param`` (full shape) before ``step()``. Raises ValueError when frozen
    or before any backward."""
    rt, g, s = _locate(param, "safe_set_full_grad")
    grad = _grad(rt, g, s)
    if grad is None:
        raise ValueError(f"safe_set_full_grad: {s.name!r} has no gradient (frozen, or no backward yet)")
    _set_full(g, s, grad, value.to(grad.dtype), "safe_set_full_grad")
    rt.grad_edited(g, grad)  # an offloaded store's copy (or speculative step) follows the edit


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of ``param``'s fp32 master value (1-D, possibly empty); None when frozen."""
    rt, g, s = _locate(param, "safe_get_local_fp32_param")
    master = _master(rt, g, s)
    return None if master is None else _local(g, s, master)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's piece of ``param``'s fp32 master value; then refresh the model's copies (collective)."""
    rt, g, s = _locate(param, "safe_set_local_fp32_param")
    master = _master(rt, g, s)
    if master is None:
        raise ValueError(f"safe_set_local_fp32_param: {s.name!r} is frozen (no fp32 master weights)")
    rt.params.before_write()  # stage 3's master may be the stored shard that peers read (shared windows)
    _set_local(g, s, master.data, value.to(master.dtype), "safe_set_local_fp32_param")
    _refresh(rt, g, master)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of ``param``'s reduced gradient (1-D); None when frozen or before any backward."""
    rt, g, s = _locate(param, "safe_get_local_grad")
    grad = _grad(rt, g, s)
    return None if grad is None else _local(g, s, grad)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Overwrite this rank's piece of ``param``'s reduced gradient. Raises ValueError when there is none."""
    rt, g, s = _locate(param, "safe_set_local_grad")
    grad = _grad(rt, g, s)
    if grad is None:
        raise ValueError(f"safe_set_local_grad: {s.name!r} has no gradient (frozen, or no backward yet)")
    _set_local(g, s, grad, value.to(grad.dtype), "safe_set_local_grad")
    rt.grad_edited(g, grad)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's piece of ``param``'s optimizer state ``optim_state_key`` (1-D); None when frozen."""
    rt, g, s = _locate(param, "safe_get_local_optimizer_state")
    t = _state(rt, g, s, optim_state_key, "safe_get_local_optimizer_state")
    if t is None or t.dim() == 0:
        return t
    return _local(g, s, t)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's piece of ``param``'s optimizer state ``optim_state_key``."""
    rt, g, s = _locate(param, "safe_set_local_optimizer_state")
    state = _state_dict(rt, g, s, optim_state_key, "safe_set_local_optimizer_state")
    if state is None:
        raise ValueError(f"safe_set_local_optimizer_state: {s.name!r} is frozen (no optimizer state)")
    t = state[optim_state_key]
    _set_local(g, s, t, value.to(t.dtype), "safe_set_local_optimizer_state")
    rt.master.load_state_shard(g, state)


class MasterRowScaler:
    """Multiply rows of parameters' fp32 master weights in place, this rank's pieces of them (MuonClip's
    ``ScaleRows`` under an engine): call it for each parameter, then :meth:`finish` once, on every rank, with the
    same calls (collective: the edited master shards go back to the master store and the model's parameters
    follow)."""

    def __init__(self):
        self.touched: dict[tuple[int, int], tuple] = {}  # (id(runtime), flat-group index) -> (runtime, group, master)

    @torch.no_grad()
    def __call__(self, param: torch.nn.Parameter, per_row: torch.Tensor) -> None:
        """Scale row ``r`` of ``param`` (logical shape ``(rows, ...)``) by ``per_row[r]``.

        Raises:
            ValueError: ``param`` is frozen or in no live engine, or ``per_row`` is not one value per row.
        """
        rt, g, s = _locate(param, "qk_clip")
        if per_row.numel() != s.shape[0]:
            raise ValueError(f"qk_clip: {s.name!r} has {s.shape[0]} rows, got {per_row.numel()} factors")
        key = (id(rt), g.index)
        if key not in self.touched:
            master = _master(rt, g, s)
            if master is None:
                raise ValueError(f"qk_clip: {s.name!r} is frozen (no fp32 master weights to scale)")
            if not any(k[0] == id(rt) for k in self.touched):
                rt.params.before_write()  # collective: the same first call on every rank
            self.touched[key] = (rt, g, master)
        master = self.touched[key][2]
        cols = s.numel // s.shape[0]
        for lo, hi, sh_lo in _pieces(g, s):
            rows = torch.arange(lo, hi) // cols
            master.view(-1)[sh_lo : sh_lo + hi - lo].mul_(per_row.reshape(-1)[rows].to(master.device, master.dtype))

    def finish(self) -> None:
        """Hand the edited master shards back and refresh the model's parameters (collective)."""
        runtimes = {}
        for rt, g, master in self.touched.values():
            rt.master.load_master_shard(g, master.detach())
            runtimes[id(rt)] = rt
        for rt in runtimes.values():
            rt.load_master_shards(rt.shards())
        self.touched.clear()
