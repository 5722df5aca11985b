"""``ZenFlowMaster``: ZeRO-Offload with the important columns stepped on the device every step (ZenFlow).

DeepSpeed 0.19.8's ZenFlow (Lan et al. 2025, arXiv 2505.12242), stages 1 and 2, as zero_core's master store. The
rule follows DeepSpeed's ``ZenFlowZeroOptimizer`` and ``ZenFlowSelectiveAdamW``. Per optimizer step ``t`` (1, 2,
...; a step skipped for overflow does not count), with ``W`` = ``full_warm_up_rounds``, ``U`` =
``update_interval``, ``S`` = :attr:`ZenFlowConfig.select_steps` (0: select once) and ``g_t`` the step's gradient
shard, unscaled (1/loss scale) and divided by ``U`` (DeepSpeed runs ZenFlow with ``gradient_accumulation_steps`` =
``U``, so its loss is divided by ``U``; with ``"auto"`` nothing is divided):

* ``t <= W``: the host steps every element with ``g_t`` clipped by its own norm (plain ZeRO-Offload, CPU Adam).
* At ``t = W + 1`` and at every later ``t`` with ``(t - 1) % S == 0``, the columns are selected from ``g_t``
  (``zero_offload.zenflow_columns``). The device's values of the old selection go back to the host master; the
  new selection takes its values from the host and starts with zero Adam moments (DeepSpeed clears the selective
  optimizer's moments at every selection; the host keeps its own moments of every element).
* Every step after warm-up, the selected elements take one AdamW step on the device with ``g_t``, not clipped,
  bias-corrected at the count of device steps ``t - W`` (DeepSpeed's selective optimizer is torch's AdamW with its
  own step count, stepped from the selected gradients before any clipping), with the param group's lr, betas, eps
  and weight decay (decoupled whatever the optimizer, as DeepSpeed); the host adds ``g_t`` of every element into
  its accumulator.
* At an update boundary (``(t - W) % U == 0``; also ``t % S == 0``, right before a re-selection; with ``U``
  ``"auto"``, when for ``auto_ratio`` of the matrices the accumulated |gradient| per unselected element reaches
  the running mean per selected element in one step) the host steps every element with the accumulated gradient
  (the sum of the ``g_t``; with ``"auto"`` their mean), clipped by its global norm, in one CPU Adam step
  bias-corrected at step ``t`` (DeepSpeed passes its global step). Its new values reach the parameters for the
  unselected elements only: the device's values win for the selected ones.
* ``overlap_step``: the host step runs in a worker thread and its result is applied at the next boundary (or
  before the next selection, whichever comes first), so the training thread never waits for it except there.

Columns are ranked over the whole parameter (summed over the ranks' pieces), so every rank selects the same
columns; DeepSpeed ranks each rank's whole columns separately. Steps are optimizer steps: with
``gradient_accumulation_steps`` > 1 each step's gradient is the boundary's accumulated one.

:attr:`ZenFlowMaster.trace` records each host update (its first and last gradient step, when it was launched and
when its values reached the parameters): ``applied - last`` is 0 without ``overlap_step`` and at most
``update_interval`` with it (the staleness bound). Checkpoints hold the parameters as the model sees them and the
Adam state with the device's moments for the selected columns; the accumulated gradient not yet stepped is not
saved, and a host step in flight is waited for: its moments are saved, its weights (due at the next boundary) are
not. The saved ``step`` is the ZenFlow step count, which a load restores; a resumed run selects columns afresh at
its first step.
Parameters that got no gradient in a step are stepped with a zero gradient (ZenFlow accumulates over steps).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from zero_comm import all_reduce
from zero_core.master import MasterStoreInputs
from zero_kernels import adam_step
from zero_kernels.adam_reference import adam_step_reference
from zero_offload.master_store import OffloadMaster, OffloadOptions, offered
from zero_offload.steppers import adam_hyper
from zero_offload.zenflow_columns import ColumnPlan


@dataclass
class HostUpdate:
    """One host step of the accumulated gradients.

    Attributes:
        first, last: the optimizer steps whose gradients it steps (inclusive).
        launched: the step at whose end it started.
        applied: the step at which its values reached the parameters (None while in flight).
    """

    first: int
    last: int
    launched: int
    applied: int | None = None


class _Selected:
    """The device's share of one shard: positions, fp32 master values and Adam moments of the selected elements."""

    __slots__ = ("idx", "idx_host", "master", "exp_avg", "exp_avg_sq")

    def __init__(self, idx, idx_host, master, exp_avg, exp_avg_sq):
        self.idx, self.idx_host, self.master, self.exp_avg, self.exp_avg_sq = idx, idx_host, master, exp_avg, exp_avg_sq


class ZenFlowMaster(OffloadMaster):
    """The ``zero_optimization.zenflow`` master store (device ``cpu`` offload); see the module docstring.

    Args:
        zenflow: the validated ``zero_core.ZenFlowConfig``.
        gradient_clipping: the max global gradient norm (0: off); ZenFlow clips its host updates itself.
        world: the size of ``group`` (the column ranking and the clipping norm sum over its ranks).
        options: as :class:`OffloadMaster` (device ``cpu``; ``pin_memory`` and ``sub_group_size`` are used).
        the rest: as :class:`OffloadMaster`.

    Raises:
        ValueError: an optimizer other than Adam/AdamW (ZenFlow's device step is Adam's), named with the key.
    """

    def __init__(self, *, zenflow, gradient_clipping: float, world: int, **offload):
        self.cfg = zenflow
        self._clip = gradient_clipping
        self._across_ranks = world > 1  # column sums and the clipping norm are all-reduced
        self.steps = 0  # optimizer steps taken (overflow-skipped ones excluded)
        self.window = 0  # steps accumulated since the last host update
        self.trace: list[HostUpdate] = []
        self.selections: list[int] = []  # steps at which columns were (re-)selected
        self._sel: list[_Selected] = []
        self._acc: list[torch.Tensor] = []  # host accumulators of g_t, one per shard
        self._params: list[torch.Tensor] = []  # host fp32 values the parameters hold now, one per shard
        self._chosen: torch.Tensor | None = None  # bool per global column: selected now
        self._fresh = False  # select at the next step after warm-up whatever select_interval says (after a load)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, HostUpdate] | None = None
        self._crit_mean: torch.Tensor | None = None  # update_interval "auto": per matrix, mean |g| per selected
        self._noncrit: torch.Tensor | None = None  # ... and accumulated |g| per unselected element
        super().__init__(**offload)  # the host masters (master_shard reads _params above, still empty)
        self.watches_grads = False  # step reads the reducer's whole gradient shard: on_grad_ready does nothing
        for g in self._groups:
            if adam_hyper(self.optimizer, self.param_groups[g.group_index]) is None:
                raise ValueError(f"zero_optimization.zenflow steps Adam/AdamW only (its device step is Adam's); got "
                                 f"optimizer {type(self.optimizer).__name__} (or amsgrad/maximize set)")  # fmt: skip
        self.plan = ColumnPlan(self._groups)
        self._params = [self.store.master_view(i).clone() for i in range(len(self._groups))]
        self._acc = [torch.zeros_like(p) for p in self._params]
        for gi, pg in enumerate(self.param_groups):
            pg["params"] = [self._params[i] for i, g in enumerate(self._groups) if g.group_index == gi]
        if self.cfg.overlap_step:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-zenflow")
            threads = worker_threads(self.cfg.pt_reserved_cores_perc)
            for slot in self.store.slots:
                slot.stepper.num_threads = threads  # CPU Adam's OpenMP threads in the worker

    @classmethod
    def from_inputs(cls, inputs: MasterStoreInputs, *, zenflow, options: OffloadOptions | None = None) -> ZenFlowMaster:
        """The store from what the runtime offers, the ``zenflow`` section and the ``offload_optimizer`` keys."""
        return cls(zenflow=zenflow, gradient_clipping=inputs.gradient_clipping, world=inputs.world,
                   options=options or OffloadOptions(), **offered(inputs))  # fmt: skip

    @classmethod
    def builder(cls, zenflow, *, pin_memory: bool = False,
                sub_group_size: int = 1_000_000_000) -> Callable[[MasterStoreInputs], ZenFlowMaster]:  # fmt: skip
        """What ``ZeroRuntime(master_store=...)`` takes for the ``zenflow`` section (host memory offload)."""
        options = OffloadOptions("cpu", pin_memory=pin_memory, sub_group_size=sub_group_size)
        return functools.partial(cls.from_inputs, zenflow=zenflow, options=options)

    # ------------------------------------------------------------------ training
    def on_grad_ready(self, bucket, grad_shard: torch.Tensor, boundary: bool | None, start: int | None = None) -> None:
        """Nothing: ``step`` reads the whole gradient shard (the device needs it for the selected columns)."""

    def grad_edited(self, g, shard: torch.Tensor) -> None:
        """Nothing to redo: ``step`` reads the reducer's shard as it is then."""

    def step(self, decision) -> bool:
        """One ZenFlow step (module docstring); on overflow nothing changes and False is returned."""
        self.store.begin_round()
        if decision.overflow:
            return False
        t = self.steps + 1
        grads = [decision.grad_shards[g.index] for g in self._groups]
        interval = self.cfg.update_interval
        div = 1 if interval == "auto" else int(interval)
        scale = 1.0 / self._loss_scaler.scale
        if div != 1:
            scale /= div
        if t <= self.cfg.full_warm_up_rounds:
            for i, grad in enumerate(grads):
                self.store.receive_grad(i, 0, grad)
            self.store.step(scale * self._clip_factor(decision.grad_norm / div))
            self._apply(HostUpdate(t, t, t), t)
        else:
            if self._fresh or self._selects(t):
                self._settle(t)
                self._select(t, grads)
                self._fresh = False
            self._device_step(t, grads, scale)
            for acc, grad in zip(self._acc, grads):
                acc.add_(grad.detach().to("cpu", torch.float32), alpha=scale)
            self.window += 1
            if self._boundary(t, grads, scale):
                self._host_update(t)
        self.steps = t
        return True

    def _clip_factor(self, norm: float) -> float:
        """``gradient_clipping``'s factor for a gradient of global norm ``norm`` (as ``ZeroRuntime.step``)."""
        clip = self._clip
        return min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0

    def _selects(self, t: int) -> bool:
        """Columns are (re-)selected at step ``t``: the first step after warm-up, then every ``select_steps``
        steps counted from step 1 (DeepSpeed's ``micro_step % select_interval == 0``)."""
        warm, every = self.cfg.full_warm_up_rounds, self.cfg.select_steps
        return t - 1 >= warm and (t - 1 == warm or (every > 0 and (t - 1) % every == 0))

    def _boundary(self, t: int, grads, scale: float) -> bool:
        interval = self.cfg.update_interval
        if interval == "auto":
            hit = self._auto_asks(grads, scale)
        else:  # DeepSpeed's grid of gradient accumulation boundaries, counted from the end of warm-up
            hit = (t - self.cfg.full_warm_up_rounds) % int(interval) == 0
        return hit or self._selects(t + 1)

    def _column_sums(self, grads) -> torch.Tensor:
        sums = torch.zeros(self.plan.num_columns, dtype=torch.float32, device=self._param_device)
        self.plan.column_sums(grads, sums)
        if self._across_ranks and sums.numel():
            all_reduce(sums, self._group).wait()
        return sums

    def _auto_asks(self, grads, coef: float) -> bool:
        """``update_interval`` "auto": per matrix, the running mean over the window of |g| per selected element
        against the accumulated |g| per unselected element; an update when ``auto_ratio`` of the matrices (those
        with unselected columns) have the latter at least as large."""
        sums = self._column_sums(grads) * coef
        crit, noncrit, eligible = [], [], []
        for base, cols, rows in self.plan.matrices:
            chosen = self._chosen[base : base + cols]
            part = sums[base : base + cols]
            k = int(chosen.sum())
            crit.append(part[chosen].sum() / max(1, k * rows))
            noncrit.append(part[~chosen].sum() / max(1, (cols - k) * rows))
            eligible.append(k < cols)
        if not crit or not any(eligible):
            return False
        crit, noncrit = torch.stack(crit), torch.stack(noncrit)
        if self.window == 1:
            self._crit_mean, self._noncrit = crit, noncrit
        else:
            self._crit_mean = self._crit_mean + (crit - self._crit_mean) / self.window
            self._noncrit = self._noncrit + noncrit
        mask = torch.tensor(eligible, device=crit.device)
        asking = int(((self._noncrit >= self._crit_mean) & mask).sum())
        return asking >= self.cfg.auto_ratio * int(mask.sum())

    @torch.no_grad()
    def _device_step(self, t: int, grads, scale: float) -> None:
        """One AdamW step of the selected elements where the parameters live, gradient not clipped, bias-corrected
        at the count of device steps; their values reach the parameters."""
        count = t - self.cfg.full_warm_up_rounds
        for i, (sel, grad) in enumerate(zip(self._sel, grads)):
            if not sel.idx.numel():
                continue
            g = grad.index_select(0, sel.idx).to(torch.float32)
            m, v = sel.exp_avg, sel.exp_avg_sq
            if self.cfg.offload:  # moments live in host memory between steps
                m, v = m.to(g.device), v.to(g.device)
            hyper = adam_hyper(self.optimizer, self.param_groups[self._groups[i].group_index])
            hyper.update(adamw_mode=True, bias_correction=True)  # DeepSpeed's selective optimizer is torch's AdamW
            run = adam_step if g.device.type == "cpu" else adam_step_reference
            run(sel.master, g, m, v, step=count, grad_scale=scale, **hyper)
            if self.cfg.offload:
                sel.exp_avg.copy_(m)
                sel.exp_avg_sq.copy_(v)
            self._params[i].index_copy_(0, sel.idx_host, sel.master.to("cpu"))

    def _host_update(self, t: int) -> None:
        """Step every element on the host with the accumulated gradient, clipped by its global norm (now, or in
        the worker)."""
        update = HostUpdate(t - self.window + 1, t, t)
        mean = 1.0 / self.window if self.cfg.update_interval == "auto" else 1.0
        self.window = 0
        if self._pool is not None:
            self._settle(t)  # the worker's buffers are free again, its result applied
        coef = mean * self._clip_factor(self._acc_norm() * mean)
        for i, acc in enumerate(self._acc):
            self.store.receive_grad(i, 0, acc)
            acc.zero_()
        for slot in self.store.slots:  # bias correction at step t, not at the count of host updates (as DeepSpeed)
            slot.stepper.step_count = t - 1
        if self._pool is None:
            self.store.step(coef)
            self._apply(update, t)
        else:
            self._pending = (self._pool.submit(self.store.step, coef), update)

    def _acc_norm(self) -> float:
        """Global L2 norm of the accumulated gradient (every rank's shards); 0 when clipping is off."""
        if self._clip <= 0:
            return 0.0
        local = torch.zeros(1, dtype=torch.float64)
        for acc in self._acc:
            local += acc.double().square().sum()
        if self._across_ranks:
            all_reduce(local, self._group).wait()
        return float(local.sqrt())

    def _settle(self, t: int) -> None:
        """Wait for a host step in flight and apply its values at step ``t``."""
        if self._pending is None:
            return
        fut, update = self._pending
        self._pending = None
        fut.result()
        self._apply(update, t)

    @property
    def in_flight(self) -> HostUpdate | None:
        """The host update running in the worker now (``overlap_step``; ``applied`` still None), else None."""
        return self._pending[1] if self._pending is not None else None

    def wait_host_step(self) -> None:
        """Block until a host step in flight (``overlap_step``) has finished; its values still reach the parameters
        at the next boundary, as without the wait. Checkpoints and loads call it; so may a caller that times steps
        and wants none of this one's host work running during the next."""
        if self._pending is not None:
            self._pending[0].result()

    _wait = wait_host_step

    def _apply(self, update: HostUpdate, t: int) -> None:
        """The host masters become the parameters' values, except for the selected elements (the device's)."""
        for i, params in enumerate(self._params):
            params.copy_(self.store.master_view(i))
            if self._sel and self._sel[i].idx.numel():
                params.index_copy_(0, self._sel[i].idx_host, self._sel[i].master.to("cpu"))
        update.applied = t
        self.trace.append(update)

    @torch.no_grad()
    def _select(self, t: int, grads) -> None:
        """Give the old selection's values back to the host, choose the columns, take the new ones (zero moments)."""
        self._give_back()
        self._chosen = self.plan.choose(self._column_sums(grads), self.cfg.topk_ratio)
        self._take()
        self.selections.append(t)

    def _give_back(self) -> None:
        """The device's values of the selected elements become the host master's (DeepSpeed's fp32 sync from the
        parameters); the host keeps its own moments."""
        for i, sel in enumerate(self._sel):
            if sel.idx.numel():
                self.store.master_view(i).index_copy_(0, sel.idx_host, sel.master.to("cpu"))

    def _take(self) -> None:
        self._sel = []
        home = torch.device("cpu") if self.cfg.offload else self._param_device
        for i in range(len(self._groups)):
            idx = self.plan.selected_positions(self._chosen, i).to(self._param_device)
            idx_host = idx.to("cpu")
            zeros = torch.zeros(idx.numel(), dtype=torch.float32, device=home)
            self._sel.append(_Selected(idx, idx_host, self.store.master_view(i)[idx_host].to(self._param_device),
                                       zeros, zeros.clone()))  # fmt: skip

    def _reload(self, keep_selection: bool) -> None:
        """After a load or an edit of the host state: a host step in flight lands now and the parameters take the
        host masters; the selection takes them again, keeping its moments (an edit), or is dropped with the
        accumulated gradient, to be made afresh at the next step after warm-up (a load)."""
        self._settle(self.steps)
        for i, params in enumerate(self._params):
            params.copy_(self.store.master_view(i))
        if keep_selection and self._sel:
            for i, sel in enumerate(self._sel):
                sel.master.copy_(self.store.master_view(i)[sel.idx_host].to(sel.master.device))
            return
        self._sel, self._chosen, self._fresh, self.window = [], None, True, 0
        for acc in self._acc:
            acc.zero_()

    # ------------------------------------------------------------------ parameters and checkpoints
    @torch.no_grad()
    def write_params(self, bucket, dst: torch.Tensor) -> None:
        """This rank's chunk of ``bucket`` as the parameters hold it now, in ``dst``'s dtype."""
        i = self._pos[bucket.group.index]
        dst.copy_(self._params[i][bucket.shard_offset : bucket.shard_offset + dst.numel()])

    def master_shard(self, g) -> torch.Tensor | None:
        """The fp32 values the parameters hold now (a stable host tensor): host masters, the selected elements'
        from the device."""
        i = self._pos.get(g.index)
        if i is None:
            return None
        return self._params[i] if self._params else super().master_shard(g)

    def state_shard(self, g) -> dict:
        """Adam's state in torch's layout (copies): the selected elements' moments taken from the device, ``step``
        the ZenFlow step count."""
        i = self._pos.get(g.index)
        if i is None:
            return {}
        self._wait()
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.store.shard_state(i).items()}
        if "step" in state:  # ZenFlow's step count (the device's; the host's counts its updates)
            state["step"] = torch.tensor(float(self.steps))
        if self._sel and self._sel[i].idx.numel() and "exp_avg" in state:
            sel = self._sel[i]
            state["exp_avg"].index_copy_(0, sel.idx_host, sel.exp_avg.to("cpu"))
            state["exp_avg_sq"].index_copy_(0, sel.idx_host, sel.exp_avg_sq.to("cpu"))
        return state

    @torch.no_grad()
    def write_master(self, g, where: slice, values: torch.Tensor) -> None:
        """Overwrite elements ``where`` of ``g``'s master: the host master and the parameters' values (the
        device's selected values too)."""
        i = self._pos[g.index]
        self._wait()
        self._give_back()
        live = self.store.master_view(i)
        live[where] = values
        self._reload(keep_selection=True)

    def load_master_shard(self, g, shard: torch.Tensor) -> None:
        """Load ``g``'s master shard (host master and parameters); columns are selected afresh at the next step."""
        self._wait()
        self._give_back()
        super().load_master_shard(g, shard)
        self._reload(keep_selection=False)

    def load_state_shard(self, g, state: dict) -> None:
        """Load ``g``'s Adam state into the host; its ``step`` becomes the ZenFlow step count (warm-up, selection
        and the device's bias correction continue from it); columns are selected afresh at the next step."""
        self._wait()
        self._give_back()
        super().load_state_shard(g, state)
        if state.get("step") is not None:
            self.steps = int(torch.as_tensor(state["step"]).max())
        self._reload(keep_selection=False)

    def clear_state(self, g) -> None:
        """Forget ``g``'s Adam state (host and device); columns are selected afresh at the next step."""
        self._wait()
        self._give_back()
        super().clear_state(g)
        self._reload(keep_selection=False)

    def close(self) -> None:
        """Wait for a host step in flight, stop the worker, then free everything (``OffloadMaster.close``)."""
        self._wait()
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._sel, self._acc, self._params = [], [], []
        super().close()


def worker_threads(reserved: float) -> int:
    """Threads of the host step's worker: the cores left after ``pt_reserved_cores_perc``, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, int(cores * (1.0 - reserved)))
