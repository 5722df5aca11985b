"""``HostOptimizer``: fp32 master shards, their gradients and optimizer state in host memory (ZeRO-Offload).

ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840, sections 4-5): the device keeps parameters in the storage dtype;
each reduced gradient shard is copied to the host as its bucket finishes, the host steps the fp32 master shard with
a vectorised CPU Adam, and the updated values are written back in the storage dtype for the core to all-gather.
Given the runtime's side streams, each gradient range is copied to the host on the copy stream without blocking the
host (the training thread goes on with backward), and whoever steps a sub-group (the training thread, or
SuperOffload's worker) first waits for that copy only.
Adam/AdamW (torch's or zero_kernels' class) is stepped by ``zero_kernels.adam_step`` in one pass (gradient x
1/loss_scale x clip coefficient, update, bf16 copy-out); any other ``torch.optim`` class is stepped by torch on
the host. DeepSpeed's Twin-Flow ``ratio`` keeps the first ``1 - ratio`` of the sub-groups (those whose gradients
backward produces last) on the device, stepped there by torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zero_core.comm_context import CommContext
from zero_offload.host_memory import host_empty
from zero_offload.steppers import AdamStepper, Stepper, TorchStepper, adam_hyper
from zero_offload.subgroups import SubGroup, plan_sub_groups

PIN_KEY = "zero_optimization.offload_optimizer.pin_memory"


class _Slot:
    """One sub-group's tensors: master range, gradient range, optional bf16 staging, its stepper, a backup."""

    __slots__ = ("sg", "master", "grad", "out", "stepper", "backup", "received", "copied")

    def __init__(self, sg: SubGroup, master: torch.Tensor, grad: torch.Tensor, out: torch.Tensor | None,
                 stepper: Stepper):  # fmt: skip
        self.sg, self.master, self.grad, self.out, self.stepper = sg, master, grad, out, stepper
        self.backup: torch.Tensor | None = None
        self.received = 0
        self.copied = None  # the event of the last copy into ``grad`` on the copy stream, until waited for


class HostOptimizer:
    """Master shards and optimizer state of one rank, stepped on the host sub-group by sub-group.

    Args:
        masters: this rank's fp32 master shards (1-D, one per flat group; any device); values are copied.
        group_indices: the user's optimizer param group of each shard (hyper-parameters are read from there at
            every step, so LR schedulers acting on ``optimizer`` are followed).
        optimizer: the user's optimizer: Adam/AdamW (torch's or ``zero_kernels.CPUAdam``, no amsgrad/maximize)
            runs on CPU Adam; any other class is instantiated per sub-group and stepped by torch.
        sub_group_size: most elements per sub-group (``zero_optimization.sub_group_size``).
        ratio: fraction of sub-groups stepped on the host (``offload_optimizer.ratio``); the others stay on
            ``device``.
        pin_memory: page-locked host buffers where possible (``offload_optimizer.pin_memory``; falls back with one
            warning on CPU-only torch).
        out_dtype: storage dtype of the parameters written back (bf16 uses the fused copy-out of CPU Adam).
        device: where the parameters live (device sub-groups are kept there); default: the first master's device.
        num_threads: OpenMP threads of CPU Adam (None: torch's setting).
        cuts: per shard, offsets where sub-groups must end (parameter boundaries; see ``plan_sub_groups``).
        comm: the runtime's side streams (``zero_core.comm_context.CommContext``): gradients from ``device`` are
            copied to host memory on its ``copy_stream`` (asynchronous into pinned memory); None or inactive: each
            copy blocks until done.

    Host memory per element stepped on the host: 4 (master) + 4 (grad) + 8 (Adam moments) bytes, + 2 with bf16
    copy-out; SuperOffload's backups add 4 + 8 (see ``zero_offload.speculative``).

    Raises:
        ValueError: masters and group indices of different lengths, a group index the optimizer lacks, a non-1-D
            master, a bad ``sub_group_size`` or
            ``ratio`` (named by config key).
    """

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        group_indices: Sequence[int],
        optimizer: torch.optim.Optimizer,
        *,
        sub_group_size: int = 1_000_000_000,
        ratio: float = 1.0,
        pin_memory: bool = False,
        out_dtype: torch.dtype = torch.float32,
        device: torch.device | None = None,
        num_threads: int | None = None,
        cuts: Sequence[Sequence[int]] | None = None,
        comm: CommContext | None = None,
    ):
        if len(masters) != len(group_indices):
            raise ValueError(f"HostOptimizer: {len(masters)} master shards but {len(group_indices)} group indices")
        for i, m in enumerate(masters):
            if m.dim() != 1:
                raise ValueError(f"HostOptimizer: master shard {i} must be 1-D, got shape {tuple(m.shape)}")
        for i, g in enumerate(group_indices):
            if not 0 <= g < len(optimizer.param_groups):
                raise ValueError(f"HostOptimizer: master shard {i} names param group {g}; the optimizer has "
                                 f"{len(optimizer.param_groups)}")  # fmt: skip
        self.optimizer = optimizer
        self.group_indices = list(group_indices)
        self.out_dtype = out_dtype
        self.device = device or (masters[0].device if masters else torch.device("cpu"))
        self._comm = comm if comm is not None and comm.active else None  # copies to the host off the compute stream
        self.numels = [m.numel() for m in masters]
        self.sub_groups: list[SubGroup] = plan_sub_groups(self.numels, sub_group_size, ratio, cuts)
        self.adam = [adam_hyper(optimizer, optimizer.param_groups[g]) is not None for g in self.group_indices]
        host = [sg for sg in self.sub_groups if sg.on_host]
        host_numel = [sum(sg.numel for sg in host if sg.shard == s) for s in range(len(masters))]

        def flat(s, dtype=torch.float32):
            return host_empty(host_numel[s], dtype, pin_memory=pin_memory, key=PIN_KEY)

        self._host_master = [flat(s) for s in range(len(masters))]
        self._host_grad = [flat(s).zero_() for s in range(len(masters))]
        self._host_m = [flat(s).zero_() if self.adam[s] else None for s in range(len(masters))]
        self._host_v = [flat(s).zero_() if self.adam[s] else None for s in range(len(masters))]
        bf16_out = out_dtype == torch.bfloat16
        self._host_out = [flat(s, torch.bfloat16) if bf16_out else None for s in range(len(masters))]
        self.slots: list[_Slot] = []
        pos = [0] * len(masters)
        for sg in self.sub_groups:
            s = sg.shard
            src = masters[s].detach()[sg.start : sg.end]
            if sg.on_host:
                a, b = pos[s], pos[s] + sg.numel
                pos[s] = b
                master, grad = self._host_master[s][a:b], self._host_grad[s][a:b]
                master.copy_(src)
                out = self._host_out[s][a:b] if bf16_out else None
                if self.adam[s]:
                    stepper = AdamStepper(self._host_m[s][a:b], self._host_v[s][a:b], num_threads)
                else:
                    stepper = TorchStepper(master, optimizer, optimizer.param_groups[self.group_indices[s]])
            else:  # Twin-Flow: this sub-group stays where the parameters are, stepped by torch there
                master = src.to(self.device, torch.float32, copy=True)
                grad = torch.zeros_like(master)
                out = None
                stepper = TorchStepper(
                    master, _device_optimizer(optimizer), optimizer.param_groups[self.group_indices[s]]
                )
            self.slots.append(_Slot(sg, master, grad, out, stepper))
        self._by_shard = [[sl for sl in self.slots if sl.sg.shard == s] for s in range(len(masters))]
        self.mixed: set[int] = set()  # shards where some parameter missed a step: ``step`` per element from then

    # ------------------------------------------------------------------ gradients
    def begin_round(self) -> None:
        """Start a new accumulation round: forget which sub-groups received their gradient (the copies still in
        flight, e.g. of sub-groups a skipped step left alone, are waited for first: the reducer then clears the
        gradient shards they read)."""
        self.wait_copies()
        for sl in self.slots:
            sl.received = 0

    def receive_grad(self, shard: int, start: int, grad: torch.Tensor, accumulate: bool = False) -> list[SubGroup]:
        """Copy (or add) the reduced gradient range ``[start, start + grad.numel())`` of master shard ``shard``
        into the sub-groups' gradient buffers (host or device), in the gradient's dtype converted to fp32. A range
        from ``device`` is copied on the copy stream (``comm``), after the work queued so far on the current stream
        (the reduction that wrote it, or its landing on that stream), without blocking; reading a sub-group's
        gradient (stepping it, norms) waits for that copy.

        Returns:
            The sub-groups whose gradient became complete with this range in the current round (what SuperOffload
            may start stepping).

        Raises:
            ValueError: the range falls outside the shard.
        """
        n = grad.numel()
        if start < 0 or start + n > self.numels[shard]:
            raise ValueError(f"receive_grad: range [{start}, {start + n}) outside master shard {shard} of "
                             f"{self.numels[shard]} elements")  # fmt: skip
        flat = grad.detach().reshape(-1)
        off_stream = self._comm is not None and flat.device == self.device
        done, queued = [], []
        for sl in self._by_shard[shard]:
            a, b = max(start, sl.sg.start), min(start + n, sl.sg.end)
            if a >= b:
                continue
            src = flat[a - start : b - start]
            dst = sl.grad[a - sl.sg.start : b - sl.sg.start]
            if off_stream and not accumulate:
                queued.append((sl, dst, src))
            else:
                if sl.copied is not None:  # a copy still in flight into this range lands before the host writes it
                    self._landed(sl)
                if accumulate:
                    dst.add_(src.to(dst.device, torch.float32))
                else:
                    dst.copy_(src)  # blocking: CPU Adam reads it next
            sl.received += b - a
            if sl.received == sl.sg.numel:
                done.append(sl.sg)
        if queued:
            comm = self._comm
            with comm.on(comm.copy_stream) as event:
                for _, dst, src in queued:
                    dst.copy_(src, non_blocking=True)
            for sl, _, _ in queued:
                sl.copied = event
        return done

    def _landed(self, sl: _Slot) -> None:
        """The copies into ``sl``'s gradient have run before it is read: a host sub-group's reader (the calling
        thread) waits for them; a device sub-group's (Twin-Flow: torch steps it on the current stream) has the
        current stream wait. No-op when none is pending."""
        event = sl.copied
        if event is not None:
            if sl.sg.on_host:
                self._comm.wait_host(event)
            else:
                self._comm.use(event)
            sl.copied = None

    def wait_copies(self) -> None:
        """Wait until every gradient copy to host memory issued so far has run."""
        for sl in self.slots:
            if sl.copied is not None:
                self._landed(sl)

    def zero_grad(self) -> None:
        """Zero every gradient buffer (host and device)."""
        self.wait_copies()
        for sl in self.slots:
            sl.grad.zero_()
        self.begin_round()

    def grad_sq_norms(self) -> torch.Tensor:
        """Squared L2 norm of the gradients of each shard (fp64, on the CPU), as received (scaled by the loss
        scale): the offload's share of the global norm."""
        out = torch.zeros(len(self.numels), dtype=torch.float64)
        self.wait_copies()
        for sl in self.slots:
            out[sl.sg.shard] += torch.linalg.vector_norm(sl.grad, dtype=torch.float32).double().cpu() ** 2
        return out

    # ------------------------------------------------------------------ the step
    def hyper(self, sg: SubGroup) -> dict:
        """The step arguments of ``sg`` now (CPU Adam's for Adam shards, the user's group otherwise)."""
        gi = self.group_indices[sg.shard]
        group = self.optimizer.param_groups[gi]
        if self.adam[sg.shard] and sg.on_host:
            return adam_hyper(self.optimizer, group)
        return {k: v for k, v in group.items() if k != "params"}

    def step_sub_group(self, sg: SubGroup, coef: float) -> None:
        """Step one sub-group: master -= update(grad * coef). ``coef`` = 1/loss_scale x clip coefficient. Waits for
        the copy of its gradient first (on whichever thread steps it)."""
        sl = self.slots[sg.index]
        if sl.copied is not None:
            self._landed(sl)
        sl.stepper.step(sl.master, sl.grad, coef, self.hyper(sg), out=sl.out)

    def step(self, coef: float, skip: frozenset[int] = frozenset()) -> None:
        """Step every sub-group not in ``skip`` (sub-group indices) with gradient multiplier ``coef``."""
        for sg in self.sub_groups:
            if sg.index not in skip:
                self.step_sub_group(sg, coef)

    def snapshot(self, sg: SubGroup) -> None:
        """Copy the bits of ``sg``'s master and optimizer state aside (buffers reused across steps)."""
        sl = self.slots[sg.index]
        if sl.backup is None:
            sl.backup = torch.empty_like(sl.master)
        sl.backup.copy_(sl.master)
        sl.stepper.snapshot()

    def restore(self, sg: SubGroup) -> None:
        """Put back the bits saved by ``snapshot(sg)``: master, optimizer state and step count (the bf16 copy-out
        is rewritten from the master)."""
        sl = self.slots[sg.index]
        sl.master.copy_(sl.backup)
        sl.stepper.restore()
        if sl.out is not None:
            sl.out.copy_(sl.master)

    def write_back(self, shard: int, out: torch.Tensor, start: int = 0) -> None:
        """Write elements ``[start, start + out.numel())`` of master shard ``shard`` into ``out`` (1-D) in its dtype:
        what the parameter store all-gathers. bf16 comes from CPU Adam's fused copy-out; other dtypes are cast."""
        end = start + out.numel()
        for sl in self._by_shard[shard]:
            a, b = max(start, sl.sg.start), min(end, sl.sg.end)
            if a >= b:
                continue
            src = sl.out if sl.out is not None and out.dtype == torch.bfloat16 else sl.master
            src = src[a - sl.sg.start : b - sl.sg.start]
            out[a - start : b - start].copy_(src)

    def master_view(self, shard: int) -> torch.Tensor | None:
        """The whole master shard as one live host tensor when every sub-group of it is on the host (``ratio`` 1),
        else None (Twin-Flow keeps some of it on the device): a stable object, as checkpoints key state by it."""
        return self._host_master[shard] if self._host_master[shard].numel() == self.numels[shard] else None

    def grad_view(self, shard: int) -> torch.Tensor | None:
        """The whole gradient shard ``shard`` as received (one live host tensor) when every sub-group of it is on
        the host, else None: what a whole-matrix optimizer (Muon) steps from."""
        self.wait_copies()
        return self._host_grad[shard] if self._host_grad[shard].numel() == self.numels[shard] else None

    def refresh_out(self, shard: int) -> None:
        """Rewrite the bf16 copy-out of shard ``shard`` from its master (after the master changed outside
        ``step``, e.g. a whole-matrix optimizer's update)."""
        for sl in self._by_shard[shard]:
            if sl.out is not None:
                sl.out.copy_(sl.master)

    def clear_state(self, shard: int) -> None:
        """Forget shard ``shard``'s optimizer state (as a freshly built optimizer: zero moments, step 0)."""
        for sl in self._by_shard[shard]:
            sl.stepper.clear()

    # ------------------------------------------------------------------ state
    def checkpoint_pieces(self, shard: int) -> None:
        """The state lives in host memory: a checkpoint reads it whole (``master_shard``, ``state_shard``)."""
        return None

    def master_shard(self, shard: int) -> torch.Tensor:
        """Master shard ``shard`` as a new fp32 CPU tensor."""
        parts = [sl.master.detach().cpu() for sl in self._by_shard[shard]]
        return torch.cat(parts) if parts else torch.zeros(0)

    @torch.no_grad()
    def load_master_shard(self, shard: int, values: torch.Tensor) -> None:
        """Overwrite master shard ``shard`` with ``values`` (numel must match; any device and float dtype)."""
        flat = values.reshape(-1)
        if flat.numel() != self.numels[shard]:
            raise ValueError(f"load_master_shard: shard {shard} has {self.numels[shard]} elements, got {flat.numel()}")
        for sl in self._by_shard[shard]:
            sl.master.copy_(flat[sl.sg.start : sl.sg.end])
            if sl.out is not None:
                sl.out.copy_(sl.master)

    def shard_state(self, shard: int) -> dict:
        """Optimizer state of master shard ``shard`` in torch's layout for one flat parameter (per-element tensors
        concatenated over sub-groups, fp32 CPU; ``step`` as a 0-dim tensor): what the core's checkpoint saves for a
        non-offloaded run, so checkpoints move between offloaded and not. Empty before the first step."""
        per = [sl.stepper.state() for sl in self._by_shard[shard]]
        if not per or not per[0]:
            return {}
        out = {}
        for k, v in per[0].items():
            if torch.is_tensor(v) and v.dim() > 0:
                out[k] = torch.cat([p[k].detach().reshape(-1).cpu() for p in per])
            else:
                out[k] = v.detach().cpu().clone() if torch.is_tensor(v) else v
        steps = [float(p["step"]) for p in per if "step" in p]
        if shard in self.mixed or len(set(steps)) > 1:  # a parameter missed steps: per element, as the core
            sls = self._by_shard[shard]
            out["step"] = torch.cat([torch.full((sl.sg.numel,), float(p["step"])) for sl, p in zip(sls, per)])
        return out

    @torch.no_grad()
    def load_shard_state(self, shard: int, state: dict) -> None:
        """Take ``state`` (as ``shard_state`` gives, or a torch Adam state of the flat shard) for shard ``shard``."""
        if not state:
            return
        for sl in self._by_shard[shard]:
            part = {}
            for k, v in state.items():
                if k == "step" and torch.is_tensor(v) and v.dim() > 0:
                    part[k] = v.reshape(-1)[sl.sg.start].clone()  # per-element count: this sub-group's
                elif torch.is_tensor(v) and v.dim() > 0:
                    if v.numel() != self.numels[shard]:
                        raise ValueError(f"load_shard_state: state {k!r} of shard {shard} has {v.numel()} elements, "
                                         f"expected {self.numels[shard]}")  # fmt: skip
                    part[k] = v.reshape(-1)[sl.sg.start : sl.sg.end].to(sl.master.device, torch.float32)
                else:
                    part[k] = v.clone() if torch.is_tensor(v) else v
            sl.stepper.load_state(part)

    def host_bytes(self) -> int:
        """Bytes of host memory this object holds (masters, gradients, state, staging, backups)."""
        seen, total = set(), 0
        for sl in self.slots:
            if not sl.sg.on_host:
                continue
            ts = [sl.master, sl.grad, sl.out, sl.backup, *sl.stepper.held_tensors()]
            for t in ts:
                if torch.is_tensor(t) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        return total

    def close(self) -> None:
        """Drop every buffer (the object is unusable afterwards)."""
        self.slots.clear()
        self._by_shard = []
        self._host_master = self._host_grad = self._host_m = self._host_v = self._host_out = []


def _device_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose class steps Twin-Flow's device sub-groups: torch's AdamW/Adam for CPU Adam (its
    kernel is host-only), the user's own class otherwise."""
    from zero_kernels import CPUAdam

    if isinstance(optimizer, CPUAdam):
        group = optimizer.param_groups[0]
        cls = torch.optim.AdamW if group["adamw_mode"] else torch.optim.Adam
        return cls([torch.zeros(1, requires_grad=True)], lr=group["lr"])
    return optimizer
