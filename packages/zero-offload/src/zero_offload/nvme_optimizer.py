"""``NVMeOptimizer``: fp32 master shards and Adam state in swap files, stepped sub-group by sub-group (ZeRO-Infinity).

ZeRO-Infinity (Rajbhandari et al. 2021, arXiv 2104.07857, sec. 5-6): optimizer state lives on NVMe; the step reads
a sub-group's master and moments into a host buffer, runs CPU Adam on it and writes it back. The step is a
pipeline through the swap ring (``SwapRing``: DeepSpeed's ``buffer_count`` x sub-group buffers as one ring, where
each sub-group takes only its own size): while sub-group k is stepped, the reads of the next ones
(``pipeline_read``) and the writes of the previous ones (``pipeline_write``) are in flight in the async I/O engine,
so disk time and Adam time overlap. Reads start as backward begins (``read_ahead``), as many as the ring holds;
writes are still in flight when the step returns and land during the next forward. Only the ring, the gradients
(4 bytes per element) and the updated values in the parameters' storage dtype (``outs``, 4/N or 2/N bytes per
model element) stay in host memory. With fp32 storage ``outs`` is the master itself: the step updates it in place
and moves only the moments (8 instead of 12 bytes per element each way; the files' master segment holds the
starting values only, and every reader of the master is served from ``outs``).

One swap file per sub-group, stable name ``group<g>.sg<k>.swp`` inside the folder zero owns (``SwapFolder``),
laid out ``[master | exp_avg | exp_avg_sq]``, each segment padded to 4096 bytes so that O_DIRECT applies.

Streamed gradients (``stream_grads``, what zero_offload uses at stage 3, as ZeRO-Infinity does): the files get a
fourth segment, ``[... | grad]``. Each reduced gradient range (whole sub-groups) is written there as it arrives,
added to what an earlier micro-batch wrote (read, add, write); at the accumulation boundary its sum of squares is
kept for the clipping norm (``grad_sq_norm``). The step reads all four segments, writes the first three back, and
hands each sub-group's new values to ``param_sink`` instead of keeping a host copy. Host memory: the ring and two
gradient staging buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zero_kernels import adam_step
from zero_kernels.aio import ALIGNMENT, AsyncIO, aligned_empty
from zero_offload.host_memory import host_empty
from zero_offload.steppers import adam_hyper
from zero_offload.subgroups import SubGroup, plan_sub_groups
from zero_offload.swap_folder import SwapFolder
from zero_offload.swap_ring import Region, SwapRing

_SEGMENTS = 3  # master, exp_avg, exp_avg_sq


def _padded(numel: int) -> int:
    per = ALIGNMENT // 4
    return -(-numel // per) * per


_SQ_PIECE = 8192  # elements per float64 norm: its cast (64 KiB) stays in the heap, below the mmap threshold


def _sq_sum(x: torch.Tensor) -> float:
    """Sum of squares of ``x`` accumulated in float64, piece by piece: ``vector_norm(x, dtype=float64)`` casts the
    whole of ``x`` first on CPU (a float64 copy, twice ``x``'s bytes, held at the peak of backward: measured +6.8
    MiB for a 60m Llama MLP weight); here no copy, and 5 ms instead of 10 for 4M elements."""
    total = torch.zeros((), dtype=torch.float64)
    for part in x.reshape(-1).split(_SQ_PIECE):
        total += torch.linalg.vector_norm(part, dtype=torch.float64).square()
    return float(total)


def swap_bytes(shard_numels: Sequence[int], sub_group_size: int, stream_grads: bool = False) -> int:
    """Bytes the swap files of one rank take for master shards of ``shard_numels`` elements (and the streamed
    gradients' segment)."""
    per = _SEGMENTS + int(stream_grads)
    return sum(per * _padded(sg.numel) * 4 for sg in plan_sub_groups(shard_numels, sub_group_size))


class NVMeOptimizer:
    """Master shards and Adam state of one rank on NVMe; gradients in host memory.

    Args:
        masters: this rank's fp32 master shards (1-D, one per flat group); values are written to the swap files.
        group_indices: the user's optimizer param group of each shard.
        optimizer: Adam/AdamW (torch's or ``zero_kernels.CPUAdam``); its param groups supply hyper-parameters.
        folder: the rank's ``SwapFolder`` (created and checked by the caller, which sizes it with ``swap_bytes``).
        io: the async I/O engine (``aio`` section).
        sub_group_size: elements per sub-group (``zero_optimization.sub_group_size``).
        buffer_count: host buffers of ``buffer_numel`` elements x the segments each (``offload_optimizer.
            buffer_count``, as DeepSpeed sizes its pool), laid end to end as one ring (``SwapRing``) that each
            sub-group's segments take only their own room of; capped at what every sub-group needs at once.
        buffer_numel: elements of one buffer's segment: the largest sub-group DeepSpeed forms (whole parameters
            coalesced up to ``sub_group_size``; ``plan_nvme``'s ``buffer_numel``); by default
            min(``sub_group_size``, the largest shard), with ``stream_grads`` the largest sub-group here (the
            reads cannot start before backward's last gradient: memory is what that mode is for). Never below
            the largest sub-group here.
        pipeline_read, pipeline_write: overlap the read of the next / the write of the previous sub-group with the
            step of the current one.
        pin_memory: page-locked gradient buffers where possible.
        out_dtype: storage dtype of the parameters: the updated shard is kept in host memory in this dtype (4/N or
            2/N bytes per model element) so that writing parameters back reads nothing from disk (not with
            ``param_sink``); float32 makes it the master (``master_in_memory``).
        stream_grads: gradients go to the swap files' fourth segment as they arrive (see the module docstring);
            ranges given to ``receive_grad`` must then cover whole sub-groups.
        param_sink: ``param_sink(sub_group, values)`` receives each stepped sub-group's new fp32 values (a view
            valid during the call); no host copy of the updated shard is kept then.
        numels, source: instead of ``masters``: the shard sizes and ``source(shard, start, end)`` giving the fp32
            starting values of one sub-group, so that no whole shard is ever in host memory.

    Attributes:
        grad_io: ``writes`` / ``reads`` of gradient segments (streamed), ``read_back`` (reads for a norm that
            was not known at the boundary).
        ckpt_io: ``reads`` of segments by checkpoint saves (``checkpoint_pieces``), ``largest`` read (bytes).

    Raises:
        ValueError: an optimizer other than Adam/AdamW (named with the config key), ``buffer_count`` < 1.
        zero_kernels.aio.AioError: a swap file could not be written (ENOSPC...), naming file, offset and size.
    """

    def __init__(
        self,
        masters: Sequence[torch.Tensor],
        group_indices: Sequence[int],
        optimizer: torch.optim.Optimizer,
        *,
        folder: SwapFolder,
        io: AsyncIO,
        sub_group_size: int = 1_000_000_000,
        buffer_count: int = 4,
        buffer_numel: int | None = None,
        pipeline_read: bool = True,
        pipeline_write: bool = True,
        pin_memory: bool = False,
        out_dtype: torch.dtype = torch.float32,
        cuts: Sequence[Sequence[int]] | None = None,
        stream_grads: bool = False,
        param_sink=None,
        numels: Sequence[int] | None = None,
        source=None,
    ):
        for g in group_indices:
            if adam_hyper(optimizer, optimizer.param_groups[g]) is None:
                raise ValueError(f"zero_optimization.offload_optimizer.device='nvme' steps Adam/AdamW (no amsgrad, "
                                 f"no maximize) only; got {type(optimizer).__name__}")  # fmt: skip
        if buffer_count < 1:
            raise ValueError(f"zero_optimization.offload_optimizer.buffer_count must be >= 1, got {buffer_count}")
        self.optimizer, self.group_indices = optimizer, list(group_indices)
        self.folder, self.io = folder, io
        self.numels = list(numels) if numels is not None else [m.numel() for m in masters]
        if source is None:
            source = lambda shard, a, e: masters[shard].detach()[a:e]  # noqa: E731
        self.stream, self.param_sink = stream_grads, param_sink
        self.segments = _SEGMENTS + int(stream_grads)
        self.sub_groups: list[SubGroup] = plan_sub_groups(self.numels, sub_group_size, cuts=cuts)
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        self.steps = [0] * len(self.sub_groups)
        self.paths = [folder.file(f"group{sg.shard}.sg{sg.index}.swp") for sg in self.sub_groups]
        self._pad = [_padded(sg.numel) for sg in self.sub_groups]
        width = max(self._pad, default=0)
        # DeepSpeed's pool (buffer_count buffers of its largest sub-group) as one ring: sub-groups here end at
        # every parameter, most are small, and each takes only its own room
        if buffer_numel is None:  # as plan_nvme
            buffer_numel = width if stream_grads else min(sub_group_size, max(self.numels, default=0))
        pool = buffer_count * self.segments * max(width, _padded(buffer_numel))
        everything = self.segments * (sum(self._pad) + width)  # every sub-group at once, and the wrap's slack
        self.ring = SwapRing(min(pool, everything), io)
        self._early: dict[int, Region] = {}  # sub-group index -> its region, read started in backward
        key = "zero_optimization.offload_optimizer.pin_memory"
        self.grads, self.outs = [], []
        self._gbufs: list = []  # streamed gradients' staging buffers (below); none otherwise
        self._gwrite: list = []  # ... and the write in flight from each
        if stream_grads:  # two staging buffers: one fills while the other's write is in flight
            self._gbufs = [aligned_empty(width) for _ in range(2 if self.sub_groups else 0)]
            self._gwrite = [None] * len(self._gbufs)
            self._gnext = 0
            self._gowner: dict[int, int] = {}  # sub-group -> staging buffer of its last gradient write
            self._gwritten = [False] * len(self.sub_groups)  # written since the last step
            self._gsq: list = [None] * len(self.sub_groups)  # sum of squares once final
        else:
            self.grads = [host_empty(n, torch.float32, pin_memory=pin_memory, key=key).zero_() for n in self.numels]
        self.grad_io = {"writes": 0, "reads": 0, "read_back": 0}
        self.ckpt_io = {"reads": 0, "largest": 0}  # checkpoint_pieces: segment reads, largest read in bytes
        self._received = [0] * len(self.sub_groups)
        self.mixed: set[int] = set()  # shards where some parameter missed a step: ``step`` per element from then
        if param_sink is None:
            self.outs = [host_empty(n, out_dtype, pin_memory=pin_memory, key=key) for n in self.numels]
        # fp32 storage: ``outs`` is the master itself, so the step steps it in place and moves only the moments
        # (8 of 12 bytes per element each way); the files' master segment is written once here and not read again
        self.master_in_memory = bool(self.outs) and out_dtype == torch.float32
        self._first = int(self.master_in_memory)  # the first segment a step reads and writes
        for sg in self.sub_groups:  # initial state: master values, zero moments (and gradient)
            r = self._place_whole(sg)
            buf = self.ring.view(r)
            buf.zero_()
            buf[: sg.numel].copy_(source(sg.shard, sg.start, sg.end))
            if self.outs:
                self.outs[sg.shard][sg.start : sg.end].copy_(buf[: sg.numel])
            self.ring.write(r, r.numel, self.paths[sg.index], 0)
        self.ring.drain()

    # ------------------------------------------------------------------ I/O
    def region_numel(self, sg: SubGroup, first: int | None = None) -> int:
        """Ring elements segments ``first..`` of ``sg`` take (by default the segments a step moves)."""
        return (self.segments - (self._first if first is None else first)) * self._pad[sg.index]

    def _place_whole(self, sg: SubGroup) -> Region:
        """Room for every segment of ``sg`` (start-up: no unstepped data can be in the way)."""
        r = self.ring.place(sg.index, self.region_numel(sg, 0))
        if r is None:
            raise RuntimeError(f"NVMeOptimizer: no room for sub-group {sg.index} in the swap ring (internal error)")
        return r

    def _offset(self, sg: SubGroup) -> int:
        """Byte offset in ``sg``'s file of the first segment a step reads and writes."""
        return self._first * self._pad[sg.index] * 4

    def _start_read(self, sg: SubGroup) -> Region | None:
        """Start reading the segments a step moves of ``sg`` into new room; None when the ring is full of sub-groups
        not stepped yet."""
        r = self.ring.place(sg.index, self.region_numel(sg))
        if r is not None:
            self.ring.read(r, self.paths[sg.index], self._offset(sg))
        return r

    def _views(self, r: Region, sg: SubGroup) -> tuple[torch.Tensor, ...]:
        """(master, exp_avg, exp_avg_sq[, grad]) of ``sg`` in region ``r`` (the segments a step moves); the master
        is ``outs`` when that is the master."""
        p = self._pad[sg.index]
        segs = [self.ring.view(r, (k - self._first) * p, sg.numel) for k in range(self._first, self.segments)]
        if self._first:
            segs.insert(0, self.outs[sg.shard][sg.start : sg.end])
        return tuple(segs)

    def read_ahead(self) -> None:
        """Start the next step's reads now (backward is running: ``OffloadMaster.begin_backward``, or its first
        gradient has arrived), as many as the ring holds, so they overlap backward instead of opening the step. The
        state on disk does not change before that step (every path that writes it or uses the ring drops these
        reads first). Not with streamed gradients: the step must read their segment after backward has written
        it. Idempotent until the step (or a state read) uses them."""
        if self._early or self.stream or not self.pipeline_read:
            return
        for sg in self.sub_groups:
            r = self._start_read(sg)
            if r is None:
                break
            self._early[sg.index] = r

    def _drop_early(self) -> None:
        """Give the early reads' room back (their reads are still waited for before the room is reused)."""
        for r in self._early.values():
            self.ring.release(r)
        self._early.clear()

    def flush(self) -> None:
        """Wait for every read and write in flight (the step leaves its writes in flight): afterwards the swap
        files hold the last step's state and the whole ring is free.

        Raises:
            zero_kernels.aio.AioError: a pending write failed (named file, offset, size).
        """
        self._drop_early()
        try:
            self.ring.drain()
        finally:
            self._wait_grad_write()

    # ------------------------------------------------------------------ gradients
    def begin_round(self) -> None:
        self._received = [0] * len(self.sub_groups)
        if self.stream:
            self._gwritten = [False] * len(self.sub_groups)
            self._gsq = [None] * len(self.sub_groups)

    def receive_grad(self, shard: int, start: int, grad: torch.Tensor, accumulate: bool = False,
                     final: bool = True) -> list[SubGroup]:  # fmt: skip
        """Copy (or add) a reduced gradient range of master shard ``shard`` into host memory (see HostOptimizer);
        streamed: into the swap files, added to what this step already wrote, its sum of squares kept when
        ``final`` (the accumulation boundary).

        Raises:
            ValueError: the range lies outside the shard, or (streamed) cuts a sub-group.
        """
        n = grad.numel()
        if start < 0 or start + n > self.numels[shard]:
            raise ValueError(f"receive_grad: range [{start}, {start + n}) outside master shard {shard} of "
                             f"{self.numels[shard]} elements")  # fmt: skip
        if self.stream:
            return self._stream_grad(shard, start, grad.detach().reshape(-1), final)
        self.read_ahead()
        dst = self.grads[shard][start : start + n]
        src = grad.detach().reshape(-1)
        dst.add_(src.to(torch.float32)) if accumulate else dst.copy_(src)
        done = []
        for sg in self.sub_groups:
            if sg.shard == shard:
                a, b = max(start, sg.start), min(start + n, sg.end)
                if a < b:
                    self._received[sg.index] += b - a
                    if self._received[sg.index] == sg.numel:
                        done.append(sg)
        return done

    def _stream_grad(self, shard: int, start: int, src: torch.Tensor, final: bool) -> list[SubGroup]:
        end, done = start + src.numel(), []
        for sg in self.sub_groups:
            if sg.shard != shard or sg.end <= start or sg.start >= end:
                continue
            if sg.start < start or sg.end > end:
                raise ValueError(f"receive_grad: streamed range [{start}, {end}) of shard {shard} cuts sub-group "
                                 f"{sg.index} [{sg.start}, {sg.end}); sub-groups must end at unit "
                                 "boundaries")  # fmt: skip
            k, self._gnext = self._gnext, 1 - self._gnext
            if self._gwrite[k] is not None:
                self.io.wait(self._gwrite[k])
                self._gwrite[k] = None
            pad, off = self._pad[sg.index], _SEGMENTS * self._pad[sg.index] * 4
            view = self._gbufs[k][:pad]
            part = src[sg.start - start : sg.end - start]
            if self._gwritten[sg.index]:  # a later micro-batch: add to what the earlier ones wrote
                self._wait_grad_write(sg)
                self.io.wait(self.io.read(view, self.paths[sg.index], off))
                self.grad_io["reads"] += 1
                view[: sg.numel].add_(part.to(torch.float32))
            else:
                view[: sg.numel].copy_(part)
                view[sg.numel :].zero_()
            self._gsq[sg.index] = _sq_sum(view[: sg.numel]) if final else None
            self._gwrite[k] = self.io.write(view, self.paths[sg.index], off)
            self._gowner[sg.index] = k
            self.grad_io["writes"] += 1
            self._gwritten[sg.index] = True
            self._received[sg.index] = sg.numel
            done.append(sg)
        return done

    def read_grad_shard(self, shard: int) -> torch.Tensor:
        """Streamed: master shard ``shard``'s accumulated gradient as a new fp32 tensor, read from the swap files
        (zeros where nothing was written since the step)."""
        self._wait_grad_write()
        out = torch.zeros(self.numels[shard], dtype=torch.float32)
        for sg in self.sub_groups:
            if sg.shard == shard and self._gwritten[sg.index]:
                view = self._gbufs[0][: self._pad[sg.index]]
                self.io.wait(self.io.read(view, self.paths[sg.index], _SEGMENTS * self._pad[sg.index] * 4))
                self.grad_io["reads"] += 1
                out[sg.start : sg.end].copy_(view[: sg.numel])
        return out

    def write_grad_shard(self, shard: int, values: torch.Tensor) -> None:
        """Streamed: overwrite master shard ``shard``'s accumulated gradient in the swap files with ``values``
        (``numels[shard]`` elements, any float dtype) and keep its sums of squares for the norm."""
        flat = values.detach().reshape(-1)
        if flat.numel() != self.numels[shard]:
            raise ValueError(f"write_grad_shard: shard {shard} has {self.numels[shard]} elements, got {flat.numel()}")
        self._wait_grad_write()
        for sg in self.sub_groups:
            if sg.shard != shard:
                continue
            view = self._gbufs[0][: self._pad[sg.index]]
            view[: sg.numel].copy_(flat[sg.start : sg.end])
            view[sg.numel :].zero_()
            self.io.wait(self.io.write(view, self.paths[sg.index], _SEGMENTS * self._pad[sg.index] * 4))
            self.grad_io["writes"] += 1
            self._gsq[sg.index] = _sq_sum(view[: sg.numel])
            self._gwritten[sg.index] = True
            self._received[sg.index] = sg.numel

    def _wait_grad_write(self, sg: SubGroup | None = None) -> None:
        """Wait for the staging write of ``sg``'s gradient (None: all)."""
        for k, h in enumerate(self._gwrite):
            if h is not None and (sg is None or self._gowner.get(sg.index) == k):
                self.io.wait(h)
                self._gwrite[k] = None

    def zero_grad(self) -> None:
        for g in self.grads:
            g.zero_()
        self.begin_round()

    def grad_sq_norm(self) -> float:
        """Streamed: the sum of squares of this rank's accumulated gradient (read back from the files for the
        sub-groups whose last range did not arrive at the boundary)."""
        self._wait_grad_write()
        total = 0.0
        for sg in self.sub_groups:
            if not self._gwritten[sg.index]:
                continue
            if self._gsq[sg.index] is None:
                view = self._gbufs[0][: self._pad[sg.index]]
                self.io.wait(self.io.read(view, self.paths[sg.index], _SEGMENTS * self._pad[sg.index] * 4))
                self.grad_io["read_back"] += 1
                self._gsq[sg.index] = _sq_sum(view[: sg.numel])
            total += self._gsq[sg.index]
        return total

    def grad_sq_norms(self) -> torch.Tensor:
        return torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2 for g in self.grads])

    # ------------------------------------------------------------------ the step
    def step(self, coef: float, skip: frozenset[int] = frozenset()) -> None:
        """One Adam step of every sub-group with gradient multiplier ``coef``, pipelined through the swap ring; the
        updated values also land in ``outs`` (storage dtype) for ``write_back``. Reads run ahead as far as the ring
        holds (those started in backward first); the writes are left in flight when the step returns and land
        during the next forward (``flush`` waits for them; every reader of the state does).

        Args:
            coef: 1/loss_scale x clip coefficient.
            skip: sub-group indices not to step (not read or written either).

        Raises:
            zero_kernels.aio.AioError: a read or write failed (named file, offset, size); a write left in flight
                reports at the next wait (the next step, a checkpoint, ``flush``, ``close``). Files then hold
                either the old or the new values of each sub-group, whole-request granular.
        """
        for idx in [i for i in self._early if i in skip]:  # read in backward, not stepped: the room goes back
            self.ring.release(self._early.pop(idx))
        order = [sg for sg in self.sub_groups if sg.index not in skip]
        if not order:
            return
        if self.stream:
            self._wait_grad_write()
        try:
            self._pipeline(order, coef)
        except BaseException:  # a failed read or step: the next step (or flush) starts from a free ring
            self.ring.release_all()
            raise

    def _pipeline(self, order: list[SubGroup], coef: float) -> None:
        """The step's loop over ``order``: read ahead as room frees, step each sub-group as its read lands, start
        its write."""
        regions: dict[int, Region] = {}
        nxt = 0  # position in ``order`` of the next read to start
        for k, sg in enumerate(order):
            while nxt < (len(order) if self.pipeline_read else k + 1):
                r = self._early.pop(order[nxt].index, None) or self._start_read(order[nxt])
                if r is None:  # the ring is full of sub-groups still to step
                    break
                regions[nxt] = r
                nxt += 1
            r = regions.pop(k, None)
            if r is None:  # everything before k has been released: room for k is always found
                raise RuntimeError(f"NVMeOptimizer: sub-group {sg.index} was not read (internal error)")
            self.ring.settle(r)
            master, m, v, *grad = self._views(r, sg)
            self.steps[sg.index] += 1
            hyper = adam_hyper(self.optimizer, self.optimizer.param_groups[self.group_indices[sg.shard]])
            if self.stream:
                grad = grad[0]
                if not self._gwritten[sg.index]:
                    grad.zero_()  # nothing arrived this step: the file still holds the last step's
            else:
                grad = self.grads[sg.shard][sg.start : sg.end]
            adam_step(master, grad, m, v, step=self.steps[sg.index], grad_scale=coef, **hyper)
            if self.param_sink is not None:
                self.param_sink(sg, master)
            elif not self.master_in_memory:
                self.outs[sg.shard][sg.start : sg.end].copy_(master)
            p = self._pad[sg.index]  # the gradient segment is not written back
            self.ring.write(r, (_SEGMENTS - self._first) * p, self.paths[sg.index], self._offset(sg))
            if not self.pipeline_write:
                self.ring.settle(r)

    # ------------------------------------------------------------------ state
    def _load(self, sg: SubGroup) -> tuple[Region, tuple[torch.Tensor, ...]]:
        """Read ``sg``'s state (after every pending write) into the ring's start: its region and views, valid until
        the next use of the ring (the region is released at once, so nothing is left holding room)."""
        self.flush()
        r = self._start_read(sg)  # the ring is free after flush: never None
        self.ring.settle(r)
        self.ring.release(r)
        return r, self._views(r, sg)

    def master_shard(self, shard: int) -> torch.Tensor:
        """Master shard ``shard`` read back from the swap files (new fp32 tensor); a copy of ``outs`` when that is
        the master."""
        if self.master_in_memory:
            return self.outs[shard].clone()
        parts = [self._load(sg)[1][0].clone() for sg in self.sub_groups if sg.shard == shard]
        return torch.cat(parts) if parts else torch.zeros(0)

    def write_back(self, shard: int, out: torch.Tensor, start: int = 0) -> None:
        """Write elements ``[start, start + out.numel())`` of shard ``shard``'s updated values into ``out`` (with
        ``param_sink``: read from the swap files)."""
        if self.outs:
            out.copy_(self.outs[shard][start : start + out.numel()])
            return
        end = start + out.numel()
        for sg in self.sub_groups:
            if sg.shard == shard and sg.start < end and sg.end > start:
                a, e = max(start, sg.start), min(end, sg.end)
                out[a - start : e - start].copy_(self._load(sg)[1][0][a - sg.start : e - sg.start])

    def checkpoint_pieces(self, shard: int) -> dict:
        """Shard ``shard``'s master and Adam state for a checkpoint, as ``zero_core.checkpoint.pieces``
        ``StreamedShard`` values (``"master"``, ``"exp_avg"``, ``"exp_avg_sq"``; ``"step"`` a tensor as in
        ``shard_state``; no state before the first step): each is read segment by segment, one sub-group at a
        time, into the first swap buffer and written from there, so a save holds no whole shard in host memory.
        Reading starts only after every pending write (the step's, a gradient's) has landed: a sub-group is never
        read while a write still owns it. ``ckpt_io`` counts the ``reads`` and the ``largest`` read (bytes)."""
        from zero_core.checkpoint.pieces import StreamedShard

        sgs = [sg for sg in self.sub_groups if sg.shard == shard]

        def segment(k: int):
            def pieces():
                self.flush()
                for sg in sgs:
                    if k == 0 and self.master_in_memory:
                        yield self.outs[shard][sg.start : sg.end]
                        continue
                    view = self.ring.buf[: self._pad[sg.index]]  # the ring is free: flushed
                    self.io.wait(self.io.read(view, self.paths[sg.index], k * self._pad[sg.index] * 4))
                    self.ckpt_io["reads"] += 1
                    self.ckpt_io["largest"] = max(self.ckpt_io["largest"], view.numel() * 4)
                    yield view[: sg.numel]

            return StreamedShard(torch.float32, self.numels[shard], pieces)

        out = {"master": segment(0)}
        if sgs and any(self.steps[sg.index] for sg in sgs):
            counts = [float(self.steps[sg.index]) for sg in sgs]
            if shard in self.mixed or len(set(counts)) > 1:  # a parameter missed steps: per element, as shard_state
                step = StreamedShard(torch.float32, self.numels[shard],
                                     lambda: (torch.full((sg.numel,), c) for sg, c in zip(sgs, counts)))  # fmt: skip
            else:
                step = torch.tensor(counts[0])
            out.update(step=step, exp_avg=segment(1), exp_avg_sq=segment(2))
        return out

    def master_view(self, shard: int) -> None:
        """None: the master lives in files (see HostOptimizer.master_view)."""
        return None

    def clear_state(self, shard: int) -> None:
        """Zero shard ``shard``'s moments on disk and its step counts."""
        zeros = torch.zeros(self.numels[shard])
        self.load_shard_state(shard, {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros})

    def shard_state(self, shard: int) -> dict:
        """torch's Adam layout for the flat shard (``step``, ``exp_avg``, ``exp_avg_sq``); empty before a step."""
        sgs = [sg for sg in self.sub_groups if sg.shard == shard]
        if not sgs or all(self.steps[sg.index] == 0 for sg in sgs):
            return {}
        m, v = [], []
        for sg in sgs:
            _, (_, a, b, *_) = self._load(sg)
            m.append(a.clone())
            v.append(b.clone())
        counts = [float(self.steps[sg.index]) for sg in sgs]
        if shard in self.mixed or len(set(counts)) > 1:  # a parameter missed steps: per element
            step = torch.cat([torch.full((sg.numel,), c) for sg, c in zip(sgs, counts)])
        else:
            step = torch.tensor(counts[0])
        return {"step": step, "exp_avg": torch.cat(m), "exp_avg_sq": torch.cat(v)}

    @torch.no_grad()
    def _rewrite(self, shard: int, which: int, values: torch.Tensor) -> None:
        flat = values.reshape(-1)
        if flat.numel() != self.numels[shard]:
            raise ValueError(f"NVMeOptimizer: shard {shard} has {self.numels[shard]} elements, got {flat.numel()}")
        for sg in self.sub_groups:
            if sg.shard == shard:
                r, views = self._load(sg)
                views[which].copy_(flat[sg.start : sg.end])  # the master with outs as master: outs itself
                self.ring.write(r, r.numel, self.paths[sg.index], self._offset(sg))
                self.flush()

    def load_master_shard(self, shard: int, values: torch.Tensor) -> None:
        """Overwrite master shard ``shard`` in its swap files (and its storage-dtype copy)."""
        self._rewrite(shard, 0, values)
        if self.outs:
            self.outs[shard].copy_(values.reshape(-1))

    def load_shard_state(self, shard: int, state: dict) -> None:
        """Take a torch Adam state of the flat shard (as ``shard_state`` gives)."""
        if not state:
            return
        self._rewrite(shard, 1, state["exp_avg"])
        self._rewrite(shard, 2, state["exp_avg_sq"])
        step = state["step"]
        per_element = torch.is_tensor(step) and step.dim() > 0
        for sg in self.sub_groups:
            if sg.shard == shard:
                self.steps[sg.index] = int(float(step.reshape(-1)[sg.start] if per_element else step))

    def host_bytes(self) -> int:
        """Host bytes held: the swap buffers and the gradients."""
        held = [*self.grads, *self.outs]
        bufs = [self.ring.buf, *self._gbufs]
        return sum(t.untyped_storage().nbytes() for t in bufs) + sum(t.numel() * t.element_size() for t in held)

    def close(self) -> None:
        """Finish pending writes and remove zero's swap files (a clean exit)."""
        try:
            self.flush()
        finally:
            self.folder.close()
            self.ring = SwapRing(0, self.io)
