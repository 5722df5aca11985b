"""Eager fallback: a module whose code runs outside any compiled graph still gathers and releases what it uses.

Dynamo runs some code eagerly: a frame it skips (a graph break inside a loop skips the whole frame, and torch's
own ``nn`` modules then run as plain Python), or code after ``torch._dynamo.disable``. Such code would read the
empty stage-3 parameters, and the eager backward would fail on a size mismatch. So every module owning
parameters gets a forward pre-hook that, when it runs eagerly (``torch.compiler.is_compiling()`` is False; inside
tracing the hooks do nothing and leave no trace in the graph), points its parameters at views of their gathered
units. They stay gathered until the backward ends, since eager autograd reads ``param.data`` then; at
:meth:`EagerFallback.after_backward` their ``.grad`` goes through the same reduce-scatter as the graphs' and the
parameters go back to their empty storage. A forward without autograd (``torch.no_grad``, eval) releases at once.

A hook called from a skipped frame is a new frame, which Dynamo would compile as its own (``is_compiling()`` True
while tracing it: a no-op). So the hooks' frames are never compiled on their own (``skip_code``; Dynamo still
inlines them when it traces a module call) and their work runs under ``torch.compiler.disable``.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch._dynamo.eval_frame import skip_code

from zero_compile.store import UnitStore


class EagerFallback:
    """Hooks on every module that owns parameters of ``store``'s layout (see the module docstring).

    Args:
        module: the model.
        store: its :class:`~zero_compile.store.UnitStore` (``locate`` gives each parameter's unit and slot).

    Attributes:
        eager_gathers: unit gathers the hooks made (0 when everything ran compiled).
    """

    def __init__(self, module: torch.nn.Module, store: UnitStore):
        self.store = store
        self._handles = []
        self._swapped: dict[int, tuple[torch.nn.Parameter, torch.Tensor, int, int]] = {}
        self._copies: dict[int, torch.Tensor] = {}  # unit -> the hooks' own gathered copy of it
        self.eager_gathers = 0
        for mod in module.modules():
            found = [(p, store.locate(p)) for p in mod.parameters(recurse=False)]
            own = [(p, *where) for p, where in found if where is not None]
            if own:
                self._handles.append(mod.register_forward_pre_hook(self._make_pre(own)))
                self._handles.append(mod.register_forward_hook(self._make_post(own)))

    def _make_pre(self, own):
        def pre(mod, args):
            if not torch.compiler.is_compiling():
                self._gather(own)

        skip_code(pre.__code__)  # eager callers run it as written (see the module docstring)
        return pre

    def _make_post(self, own):
        def post(mod, args, out):
            if not (torch.compiler.is_compiling() or torch.is_grad_enabled()):
                self._release(own)

        skip_code(post.__code__)
        return post

    @torch.compiler.disable
    def _gather(self, own) -> None:
        for p, unit, slot in own:
            if id(p) in self._swapped:
                continue
            full = self._copies.get(unit)
            if full is None:
                # A copy, not the store's buffer: when Dynamo compiles this module's own frame after all, its graph
                # gathers the unit again and must not return a buffer its parameter inputs are views of.
                full = self._copies[unit] = self.store.wait(unit, p.dtype).clone()
                self.store.release(unit)
                self.eager_gathers += 1
            s = self.store.layout.units[unit].slots[slot]
            self._swapped[id(p)] = (p, p.data, unit, slot)
            p.data = full[s.bucket_offset : s.bucket_offset + s.numel].view(s.shape)

    @torch.compiler.disable
    def _release(self, own) -> None:
        for p, _unit, _slot in own:
            if id(p) in self._swapped:
                self._restore(id(p))

    def _restore(self, key: int) -> None:
        p, empty, unit, _ = self._swapped.pop(key)
        p.data = empty
        if not any(u == unit for _, _, u, _ in self._swapped.values()):
            self._copies.pop(unit, None)

    def after_backward(self) -> None:
        """Reduce-scatter the eager parameters' gradients (unit by unit, in unit order on every rank) and release
        them; called after the backward, before the store's flush."""
        by_unit = defaultdict(list)
        for p, _empty, unit, slot in self._swapped.values():
            if p.grad is not None:
                by_unit[unit].append((slot, p.grad))
                p.grad = None
        for unit in sorted(by_unit):
            members = sorted(by_unit[unit], key=lambda m: m[0])
            self.store.reduce(unit, [s for s, _ in members], [g for _, g in members])
        for key in list(self._swapped):
            self._restore(key)

    def close(self) -> None:
        """Remove every hook and give the parameters back their empty storage."""
        for key in list(self._swapped):
            self._restore(key)
        for h in self._handles:
            h.remove()
        self._handles.clear()
