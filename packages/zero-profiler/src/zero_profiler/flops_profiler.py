"""FLOPs profiler: a ``TorchDispatchMode`` counts every ATen op; module hooks say which module it ran in.

Why a dispatch mode: DeepSpeed's profiler replaces functions of ``torch.nn.functional`` and ``torch`` while it
profiles, and incomplete restoration made repeated runs count 1x, 2x, 3x (DeepSpeed #2097). A
dispatch mode observes ops below autograd without touching any torch attribute, and it sees what really executes
(``F.linear`` arrives as ``addmm``, ``torch.matmul`` as ``dot``/``mv``/``mm``/``bmm``).

Nothing of the profiler exists on the hot path while it is not profiling: the mode is on the dispatch stack and
the forward hooks are registered only between :meth:`FlopsProfiler.start_profile` and
:meth:`FlopsProfiler.stop_profile`.

Attribution: a forward pre-hook pushes the module (with its call path) on a stack and a forward post-hook pops
it; each op's counts are added to every node on the stack, so each node's count is inclusive and a module
shared by several parents is counted once per call, under the parent that called it (aggregating through
``children()`` counted it once per parent: DeepSpeed #7256). Ops that autograd runs (``backward``) are
recognised by ``torch._C._current_autograd_node()`` and totalled separately, without module attribution.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zero_profiler.flop_formulas import OpCount, count_op
from zero_profiler.profile import ModuleProfile, PhaseTotals, Profile

ParamCountFn = Callable[[nn.Parameter], int]


@dataclass
class _Totals:
    macs: int = 0
    flops: int = 0
    by_category: dict[str, int] = field(default_factory=dict)

    def add(self, c: OpCount) -> None:
        self.macs += c.macs
        self.flops += c.flops
        self.by_category[c.category.value] = self.by_category.get(c.category.value, 0) + c.flops

    def freeze(self) -> PhaseTotals:
        return PhaseTotals(self.macs, self.flops, dict(self.by_category))


@dataclass
class _Node:
    path: tuple[str, ...]
    module: nn.Module
    children: list[tuple[str, ...]] = field(default_factory=list)
    macs: int = 0
    flops: int = 0
    latency_s: float = 0.0
    calls: int = 0


@dataclass
class _Frame:
    node: _Node
    start: float
    recompute: bool  # an activation-checkpoint rerun inside backward: not a forward call


class _CountingMode(TorchDispatchMode):
    """Runs each op unchanged and reports its :class:`OpCount` to the profiler."""

    def __init__(self, sink: Callable[[OpCount], None]):
        super().__init__()
        self._sink = sink
        self.failed: set[str] = set()  # ops whose formula could not read their arguments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            count = count_op(func, args, kwargs, out)
        except Exception:  # an unexpected argument layout must not break the user's step; the report names it
            self.failed.add(str(func))
            return out
        if count.flops or count.macs:
            self._sink(count)
        return out


def _full_numel(p: nn.Parameter) -> int:
    return p.numel()


class FlopsProfiler:
    """Per-module parameters, MACs, FLOPs and latency of ``model``, counted exactly from the ops that run.

    Usage (DeepSpeed's ``FlopsProfiler`` method names)::

        prof = FlopsProfiler(model)
        prof.start_profile()
        loss = model(x).sum(); loss.backward()
        profile = prof.stop_profile()          # a Profile; prof.profile keeps the last one
        print(profile.format(module_depth=2, top_modules=3, detailed=True))

    or ``with FlopsProfiler(model) as prof: ...`` and then ``prof.profile``.

    Args:
        model: the module whose forward is attributed; ops outside its forward are totalled as ``outside``.
        param_count_fn: full element count of one parameter. Under ZeRO-3 a rank's parameter holds only its
            shard, so the engine passes a function returning the unsharded numel; default ``p.numel()``.

    Each ``start_profile`` starts from zero, so repeated profiles of the same work give identical counts.
    Latencies use ``time.perf_counter`` and, when CUDA is initialised, synchronise the device at each module
    boundary (slows the profiled step; only then). A module's pre-hook is prepended so its latency includes
    work that other pre-hooks do (e.g. a ZeRO-3 parameter all-gather).

    Raises ``RuntimeError`` on ``start_profile`` while already profiling and on ``stop_profile`` when not.
    """

    def __init__(self, model: nn.Module, *, param_count_fn: ParamCountFn | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.param_count_fn = param_count_fn or _full_numel
        self.profile: Profile | None = None
        self._mode: _CountingMode | None = None
        self._handles: list = []
        self._stack: list[_Frame] = []
        self._nodes: dict[tuple[str, ...], _Node] = {}
        self._forward = _Totals()
        self._backward = _Totals()
        self._outside = _Totals()
        self._sync = False
        self._names: dict[int, str] = {}
        self._relative: dict[tuple[int, int], tuple[str, ...]] = {}

    @property
    def started(self) -> bool:
        """True between ``start_profile`` and ``stop_profile``."""
        return self._mode is not None

    def start_profile(self) -> None:
        """Reset the counts, register forward hooks on every module of the model and enter the dispatch mode."""
        if self.started:
            raise RuntimeError("FlopsProfiler.start_profile() called while already profiling; call stop_profile()")
        self._stack, self._nodes = [], {}
        self._forward, self._backward, self._outside = _Totals(), _Totals(), _Totals()
        self._names, self._relative = {}, {}
        for name, m in self.model.named_modules():
            self._names[id(m)] = name
        self._add_static_nodes((), self.model, set())
        self._sync = torch.cuda.is_available() and torch.cuda.is_initialized()
        for m in self.model.modules():
            self._handles.append(m.register_forward_pre_hook(self._pre_hook, prepend=True))
            self._handles.append(m.register_forward_hook(self._post_hook, always_call=True))
        self._mode = _CountingMode(self._record)
        self._mode.__enter__()
        # The first op under any dispatch mode imports torch._dynamo (~1 s): pay it here, not in a module's latency.
        torch.empty(0).add_(0)

    def stop_profile(self) -> Profile:
        """Leave the dispatch mode, remove every hook, and return (and keep in ``self.profile``) the snapshot."""
        if not self.started:
            raise RuntimeError("FlopsProfiler.stop_profile() called without start_profile()")
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack = []
        self.profile = self._snapshot(tuple(sorted(mode.failed)))
        return self.profile

    def end_profile(self) -> None:
        """Stop if still profiling and forget the last profile (DeepSpeed's name for the final cleanup)."""
        if self.started:
            self.stop_profile()
        self.profile = None
        self._nodes = {}

    def __enter__(self) -> FlopsProfiler:
        self.start_profile()
        return self

    def __exit__(self, *exc) -> None:
        if self.started:
            self.stop_profile()

    # DeepSpeed-compatible accessors of the last profile.
    def get_total_flops(self) -> int:
        """Forward FLOPs of the model in the last profile (DeepSpeed's meaning)."""
        return self._last().forward.flops

    def get_total_macs(self) -> int:
        """Forward MACs of the model in the last profile."""
        return self._last().forward.macs

    def get_total_params(self) -> int:
        """Distinct parameters of the model, full (unsharded) element counts."""
        return self._last().total_params

    def get_total_duration(self) -> float:
        """Seconds spent in the model's forward calls in the last profile."""
        return self._last().forward_latency_s

    def print_model_profile(
        self,
        profile_step: int | None = None,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        tokens: int | None = None,
    ) -> str:
        """Format the last profile (see :meth:`Profile.format`); print it, or write it to ``output_file``.

        An ``output_file`` ending in ``.json`` receives :meth:`Profile.to_json` instead of the table.
        Returns the table text.
        """
        profile = self._last()
        text = profile.format(
            module_depth=module_depth, top_modules=top_modules, detailed=detailed, step=profile_step, tokens=tokens
        )
        if output_file is None:
            print(text)
        else:
            with open(output_file, "w") as f:
                f.write(profile.to_json() if str(output_file).endswith(".json") else text + "\n")
        return text

    def _last(self) -> Profile:
        if self.profile is None:
            raise RuntimeError("no profile yet: call start_profile() and stop_profile() first")
        return self.profile

    # Tree bookkeeping.
    def _add_static_nodes(self, path: tuple[str, ...], module: nn.Module, on_path: set[int]) -> None:
        self._nodes[path] = _Node(path, module)
        on_path = on_path | {id(module)}
        for name, child in module._modules.items():
            if child is None or id(child) in on_path:
                continue  # a module that contains itself would recurse forever
            child_path = path + (name,)
            self._nodes[path].children.append(child_path)
            self._add_static_nodes(child_path, child, on_path)

    def _child_path(self, module: nn.Module) -> tuple[str, ...]:
        if not self._stack:
            if module is self.model:
                return ()
            return (self._canonical(module),)  # called outside the root's forward
        parent = self._stack[-1].node
        key = (id(parent.module), id(module))
        relative = self._relative.get(key)
        if relative is None:
            # A direct child, or a descendant reached through a container that is never called (ModuleList).
            found = (name for name, m in parent.module.named_modules(remove_duplicate=False) if m is module and name)
            name = next(found, None)
            # Otherwise it is called by a module that does not own it: name it by its place in the model.
            relative = self._relative[key] = tuple(name.split(".")) if name else (self._canonical(module),)
        return parent.path + relative

    def _canonical(self, module: nn.Module) -> str:
        return self._names.get(id(module), type(module).__name__)

    def _pre_hook(self, module: nn.Module, args) -> None:
        path = self._child_path(module)
        node = self._nodes.get(path)
        if node is None:
            node = self._nodes[path] = _Node(path, module)
            parent = self._nodes.get(path[:-1])
            if parent is not None:
                parent.children.append(path)
        if self._sync:
            torch.cuda.synchronize()
        recompute = torch._C._current_autograd_node() is not None
        self._stack.append(_Frame(node, time.perf_counter(), recompute))

    def _post_hook(self, module: nn.Module, args, output) -> None:
        if self._sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        while self._stack:  # pop to this module's frame (a deeper frame whose post-hook never ran is closed too)
            frame = self._stack.pop()
            if not frame.recompute:
                frame.node.latency_s += now - frame.start
            if frame.node.module is module:
                frame.node.calls += 0 if frame.recompute else 1
                break

    def _record(self, count: OpCount) -> None:
        if torch._C._current_autograd_node() is not None:
            self._backward.add(count)
        elif self._stack:
            self._forward.add(count)
            for frame in self._stack:
                frame.node.macs += count.macs
                frame.node.flops += count.flops
        else:
            self._outside.add(count)

    def _fill_uncalled(self, path: tuple[str, ...]) -> None:
        """A container never called itself (``ModuleList``) gets the sum of its children, which ran inside it."""
        node = self._nodes[path]
        for child in node.children:
            self._fill_uncalled(child)
        if node.calls == 0 and node.children:
            kids = [self._nodes[c] for c in node.children]
            node.macs = sum(k.macs for k in kids)
            node.flops = sum(k.flops for k in kids)
            node.latency_s = sum(k.latency_s for k in kids)

    def _params(self, module: nn.Module) -> int:
        return sum(self.param_count_fn(p) for p in module.parameters())

    def _snapshot(self, uncounted: tuple[str, ...]) -> Profile:
        embedding = {id(p) for m in self.model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        total = self._params(self.model)
        non_embedding = sum(self.param_count_fn(p) for p in self.model.parameters() if id(p) not in embedding)
        rows: list[ModuleProfile] = []

        def visit(path: tuple[str, ...]) -> None:
            n = self._nodes[path]
            rows.append(
                ModuleProfile(
                    ".".join(path),
                    type(n.module).__name__,
                    len(path),
                    self._params(n.module),
                    n.macs,
                    n.flops,
                    n.latency_s,
                    n.calls,
                )
            )
            for child in n.children:
                visit(child)

        self._fill_uncalled(())
        visit(())
        root = self._nodes[()]
        return Profile(
            modules=tuple(rows),
            total_params=total,
            non_embedding_params=non_embedding,
            forward=self._forward.freeze(),
            backward=self._backward.freeze(),
            outside=self._outside.freeze(),
            forward_latency_s=root.latency_s,
            uncounted_ops=uncounted,
        )
