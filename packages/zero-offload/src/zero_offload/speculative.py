"""SuperOffload's speculative step, undone exactly (DeepSpeed 0.18; Lian et al. 2025, arXiv 2509.21271, sec. 4).

During the backward that ends an accumulation round, each host sub-group starts its optimizer step as soon as its
reduced gradient is complete, in a worker thread with its own share of the cores (``cpuadam_cores_perc``), while
backward continues. The step speculates that nothing changes the gradient afterwards: it uses the multiplier
1/loss_scale (no clipping). When backward ends, the global norm decides:

* finite and no clipping: the speculative updates are the step, bit for bit;
* clipping applies (the coefficient differs from 1/loss_scale): every speculated sub-group is restored from the
  bits saved before its step and stepped again with the real coefficient;
* overflow (non-finite norm): every speculated sub-group is restored and the step is skipped.

DeepSpeed rolls Adam back algebraically (inverting the update), which is not exact in floating point; here the
master range and optimizer state of each speculated sub-group are copied aside first, so the result is bitwise
what the non-speculative step gives in all three cases. Cost: 12 extra host bytes per element (4 master + 8 Adam
moments), allocated once.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from zero_offload.host_optimizer import HostOptimizer
from zero_offload.subgroups import SubGroup


def worker_threads(cores_perc: float) -> int:
    """OpenMP threads of the speculative worker: ``cpuadam_cores_perc`` of this process's usable cores, >= 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, int(cores * cores_perc))


class SpeculativeStep:
    """Run ``host``'s sub-group steps during backward and validate them at the end.

    Args:
        host: the host optimizer whose sub-groups are stepped.
        cores_perc: ``offload_optimizer.cpuadam_cores_perc`` (0, 1]: share of the cores the worker's CPU Adam uses.

    Use per accumulation round: ``begin(loss_scale)`` before the boundary backward, ``on_ready(sub_groups)`` from
    the gradient callback, then ``finish(overflow, coef)`` after the global norm is known. ``close()`` stops the
    worker.

    Raises:
        ValueError: ``cores_perc`` outside (0, 1], naming the key.
    """

    def __init__(self, host: HostOptimizer, cores_perc: float = 0.8):
        if not 0.0 < cores_perc <= 1.0:
            raise ValueError(f"zero_optimization.offload_optimizer.cpuadam_cores_perc must be in (0, 1], got "
                             f"{cores_perc}")  # fmt: skip
        self.host = host
        self.threads = worker_threads(cores_perc)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-superoffload")
        self._pending: list[tuple[SubGroup, Future]] = []
        self._coef: float | None = None
        self.stats = {"speculated": 0, "kept": 0, "redone": 0, "rolled_back": 0, "undone": 0}

    def begin(self, loss_scale: float) -> None:
        """Arm speculation for the coming backward with multiplier ``1 / loss_scale``."""
        self._coef = 1.0 / loss_scale

    def on_ready(self, sub_groups: list[SubGroup]) -> None:
        """Start the steps of ``sub_groups`` (their gradients are complete) in the worker; no-op when not armed.
        Device sub-groups (Twin-Flow) are left to ``finish``."""
        if self._coef is None:
            return
        for sg in sub_groups:
            if sg.on_host:
                self._pending.append((sg, self._pool.submit(self._speculate, sg, self._coef)))

    def _speculate(self, sg: SubGroup, coef: float) -> None:
        self.host.snapshot(sg)
        with self.host.slots[sg.index].stepper.threads(self.threads):
            self.host.step_sub_group(sg, coef)

    def undo(self, sub_groups: list[SubGroup]) -> None:
        """The gradients of ``sub_groups`` changed after their speculative steps started (edited between backward
        and ``step``): wait for those steps and restore the saved bits; ``finish`` then steps them like any
        sub-group that was not speculated."""
        wanted = {sg.index for sg in sub_groups}
        keep = []
        for sg, fut in self._pending:
            if sg.index in wanted:
                fut.result()
                self.host.restore(sg)
                self.stats["undone"] += 1
            else:
                keep.append((sg, fut))
        self._pending = keep

    def finish(self, overflow: bool, coef: float, skip: frozenset[int] = frozenset()) -> None:
        """Validate: wait for the worker, keep, redo or roll back each speculated sub-group, and step the others.

        Args:
            overflow: the global gradient norm was not finite: nothing is stepped, speculation is undone.
            coef: the real multiplier, 1/loss_scale x clip coefficient.
            skip: sub-groups not to step (their parameter got no gradient on any rank): speculation undone.

        Raises:
            whatever a speculative step raised (re-raised here, on the training thread).
        """
        pending, self._pending = self._pending, []
        armed, self._coef = self._coef, None
        for _, fut in pending:
            fut.result()
        done = set()
        for sg, _ in pending:
            done.add(sg.index)
            self.stats["speculated"] += 1
            if overflow or sg.index in skip:
                self.host.restore(sg)
                self.stats["rolled_back"] += 1
            elif coef != armed:
                self.host.restore(sg)
                self.host.step_sub_group(sg, coef)
                self.stats["redone"] += 1
            else:
                self.stats["kept"] += 1
        if not overflow:
            self.host.step(coef, skip=frozenset(done) | skip)

    def close(self) -> None:
        """Wait for in-flight steps and stop the worker thread."""
        for _, fut in self._pending:
            fut.cancel()
        self._pending = []
        self._pool.shutdown(wait=True)
