"""Checkpointed hidden states kept in host memory between forward and backward (Arctic Long Sequence Training's
activation-checkpoint offload; DeepSpeed 0.19.8's ``CheckpointHiddenStatesOffload`` and
``get_checkpoint_hidden_states_offloading_ctx_manager`` in ``deepspeed/runtime/activation_checkpointing/
offload_activations.py``).

With transformers' gradient checkpointing (non-reentrant ``torch.utils.checkpoint``), each decoder layer keeps only
its input, the hidden states ``[b, s, h]``, until backward recomputes it; over many layers and long sequences these
inputs are most of the activation memory that remains. Inside the context, the input of each checkpointed
``GradientCheckpointingLayer`` is copied to a host buffer when torch saves it and copied back to its device when
the recompute unpacks it; every other saved tensor is left alone. The newest ``keep_last_count`` inputs stay where
they are (backward needs them first). Host buffers are pinned when CUDA is present (``use_pin_memory``) and reused
from a pool of at most ``max_cpu_buffer_pool_count``.

A marked tensor already in host memory (on the CPU), a ``Parameter`` or a ``Buffer``, one smaller than
``min_offload_bytes`` and an overlapping (stride-0) view are left where they are and counted in
``stats.skipped_marked_tensors``, as DeepSpeed's ``_should_skip`` does: on a CPU-only machine nothing is offloaded.
Copies run on the current stream (``use_streams`` and ``max_fwd_stash_count`` are taken for DeepSpeed's signature;
zero does not overlap the copies with compute).

The context must be active around forward and backward (on exit, what was not restored is dropped; restoring after
exit raises ``RuntimeError``). It marks layer inputs by patching ``GradientCheckpointingLayer.__call__`` while any
such context is active (restored when the last one exits).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
]

_STATE = threading.local()  # the stack of active contexts (per thread)
_PATCH = {"users": 0, "original": None, "owned": False}  # the marker on GradientCheckpointingLayer.__call__
_LOCK = threading.Lock()


@dataclass
class CheckpointActivationOffloadStats:
    """Counts since the context was entered (DeepSpeed's fields); bytes are of the host copies."""

    saved_tensors_seen: int = 0
    marked_tensors: int = 0
    offloaded_tensors: int = 0
    restored_tensors: int = 0
    skipped_marked_tensors: int = 0
    kept_last_tensors: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0


@dataclass(frozen=True)
class _Ref:
    """What torch keeps for an offloaded tensor in place of the tensor."""

    tensor_id: int


def _stack() -> list:
    return _STATE.__dict__.setdefault("stack", [])


def _marking_call(original):
    def call(self, *args, **kwargs):
        stack = _stack()
        manager = stack[-1] if stack else None
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        marked = (manager is not None and hidden is not None and self.training and torch.is_grad_enabled()
                  and self.gradient_checkpointing)  # fmt: skip
        if marked:
            manager.mark(hidden)
        try:
            return original(self, *args, **kwargs)
        finally:
            if marked:
                manager.consume_mark(hidden)  # not saved (e.g. no grad needed): ids are reused, drop the mark

    return call


def _install_marker() -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    with _LOCK:
        if _PATCH["users"] == 0:
            _PATCH["owned"] = "__call__" in GradientCheckpointingLayer.__dict__
            _PATCH["original"] = GradientCheckpointingLayer.__dict__.get("__call__")
            GradientCheckpointingLayer.__call__ = _marking_call(GradientCheckpointingLayer.__call__)
        _PATCH["users"] += 1


def _remove_marker() -> None:
    from transformers.modeling_layers import GradientCheckpointingLayer

    with _LOCK:
        _PATCH["users"] -= 1
        if _PATCH["users"] == 0:
            if _PATCH["owned"]:
                GradientCheckpointingLayer.__call__ = _PATCH["original"]
            else:
                del GradientCheckpointingLayer.__call__
            _PATCH["original"] = None


class CheckpointHiddenStatesOffload(saved_tensors_hooks):
    """A context manager: inside, checkpointed layer inputs are kept in host memory (see the module docstring).

    Args (DeepSpeed's):
        use_pin_memory: pin the host buffers (when CUDA is available).
        use_streams, max_fwd_stash_count: accepted, unused (copies run on the current stream).
        min_offload_bytes: inputs smaller than this stay where they are.
        max_cpu_buffer_pool_count: host buffers kept for reuse after a restore.
        keep_last_count: the newest marked inputs not offloaded.

    Raises:
        ValueError: a count or ``min_offload_bytes`` below 0.
        RuntimeError: entered while already active; a tensor restored after the context exited.
    """

    def __init__(self, use_pin_memory: bool = True, use_streams: bool = True, min_offload_bytes: int = 1024,
                 max_fwd_stash_count: int = 2, max_cpu_buffer_pool_count: int = 64,
                 keep_last_count: int = 1) -> None:  # fmt: skip
        for name, value in (("min_offload_bytes", min_offload_bytes), ("max_fwd_stash_count", max_fwd_stash_count),
                            ("max_cpu_buffer_pool_count", max_cpu_buffer_pool_count),
                            ("keep_last_count", keep_last_count)):  # fmt: skip
            if value < 0:
                raise ValueError(f"CheckpointHiddenStatesOffload: {name} must be >= 0, got {value}")
        super().__init__(self._pack, self._unpack)
        self.use_pin_memory = use_pin_memory and torch.cuda.is_available()
        self.use_streams = use_streams
        self.min_offload_bytes = min_offload_bytes
        self.max_fwd_stash_count = max_fwd_stash_count
        self.max_cpu_buffer_pool_count = max_cpu_buffer_pool_count
        self.keep_last_count = keep_last_count
        self.stats = CheckpointActivationOffloadStats()
        self._marks: dict[int, int] = {}  # id(tensor) -> pending marks
        self._kept: OrderedDict[int, torch.Tensor] = OrderedDict()  # newest inputs, not offloaded (yet)
        self._host: dict[int, tuple] = {}  # tensor id -> (host buffer, device, shape, stride)
        self._restored: dict[int, torch.Tensor] = {}  # unpacked again (retain_graph): the same tensor
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._next_id = 0
        self._active = False

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload ``tensor`` when torch next saves it."""
        self._marks[id(tensor)] = self._marks.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def consume_mark(self, tensor: torch.Tensor) -> bool:
        """Take one mark of ``tensor``; whether it had one."""
        count = self._marks.get(id(tensor), 0)
        if count == 0:
            return False
        if count == 1:
            del self._marks[id(tensor)]
        else:
            self._marks[id(tensor)] = count - 1
        return True

    def _pack(self, tensor: torch.Tensor):
        self.stats.saved_tensors_seen += 1
        if not self.consume_mark(tensor):
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.device.type == "cpu" or nbytes < self.min_offload_bytes
                or isinstance(tensor, (torch.nn.Parameter, torch.nn.Buffer))
                or (tensor.numel() > 1 and 0 in tensor.stride())):  # fmt: skip
            self.stats.skipped_marked_tensors += 1
            return tensor
        self._next_id += 1
        self._kept[self._next_id] = tensor
        while len(self._kept) > self.keep_last_count:
            self._offload(*self._kept.popitem(last=False))
        return _Ref(self._next_id)

    def _offload(self, tensor_id: int, tensor: torch.Tensor) -> None:
        key = (tuple(tensor.shape), tensor.dtype)
        pool = self._pool.get(key)
        host = (
            pool.pop()
            if pool
            else torch.empty(key[0], dtype=tensor.dtype, device="cpu", pin_memory=self.use_pin_memory)
        )
        host.copy_(tensor.detach())
        self._host[tensor_id] = (host, tensor.device, tensor.shape, tensor.stride())
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += host.numel() * host.element_size()

    def _unpack(self, ref):
        if not isinstance(ref, _Ref):
            return ref
        if ref.tensor_id in self._restored:
            return self._restored[ref.tensor_id]
        if ref.tensor_id in self._kept:
            tensor = self._kept.pop(ref.tensor_id)
            self.stats.kept_last_tensors += 1
        elif ref.tensor_id in self._host:
            host, device, shape, stride = self._host.pop(ref.tensor_id)
            tensor = torch.empty_strided(shape, stride, dtype=host.dtype, device=device)
            tensor.copy_(host)
            if sum(map(len, self._pool.values())) < self.max_cpu_buffer_pool_count:
                self._pool.setdefault((tuple(shape), host.dtype), []).append(host)
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += host.numel() * host.element_size()
        else:
            raise RuntimeError(f"CheckpointHiddenStatesOffload: offloaded activation {ref.tensor_id} is gone; run "
                               "backward inside the context that ran the forward")  # fmt: skip
        self._restored[ref.tensor_id] = tensor
        return tensor

    def reset(self) -> None:
        """Drop everything stored and the counts (what entering does)."""
        self.stats = CheckpointActivationOffloadStats()
        self._marks.clear()
        self._kept.clear()
        self._host.clear()
        self._restored.clear()
        self._next_id = 0

    def __enter__(self):
        if self._active:
            raise RuntimeError("CheckpointHiddenStatesOffload is not re-entrant; use another instance to nest")
        self.reset()
        _install_marker()
        _stack().append(self)
        self._active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self._active = False
        _stack().remove(self)
        _remove_marker()
        self._marks.clear()
        self._kept.clear()
        self._host.clear()
        self._restored.clear()
        return super().__exit__(*exc)


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """A new :class:`CheckpointHiddenStatesOffload` (DeepSpeed's factory; the same arguments)."""
    return CheckpointHiddenStatesOffload(use_pin_memory, use_streams, min_offload_bytes, max_fwd_stash_count,
                                         max_cpu_buffer_pool_count, keep_last_count)  # fmt: skip
