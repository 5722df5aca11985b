"""The torch.compile backend: Dynamo graph -> AOTAutograd forward/backward graphs -> passes -> inner compiler.

One :class:`ZeroBackend` exists per schedule phase. Dynamo guards on the backend object, so installing a new one
(when the optimizer step reaches the next schedule entry) makes every graph of the model recompile once with the
new passes, on every rank at the same step; within a phase no recompilation happens. Parameters are recognised by
identity among Dynamo's example inputs (real tensors at that level), then by position among AOTAutograd's
``primals``, whose names the backward graph keeps for the inputs the forward saves. The partition is the min-cut
rematerialisation partitioner, so the forward saves the (empty) parameter placeholders rather than gathered views
of them, and the backward gathers again. Mirrors DeepCompile's backend (DeepSpeed ``deepspeed/compile/backend.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

from zero_compile.passes.base import Pass, PassContext, run_passes
from zero_compile.profile import ProfilingInterpreter

INNER = ("aot_eager", "inductor")


class ZeroBackend:
    """A Dynamo backend applying ``passes`` to every captured graph.

    Args:
        store: the :class:`~zero_compile.store.UnitStore`.
        param_index: ``id(parameter) -> (unit, slot)`` for the parameters the passes rewrite.
        passes: the pass list of this phase.
        inner: "aot_eager" (run the FX graphs as Python) or "inductor".
        step: the optimizer step this phase starts at (names debug dumps).
        plan: the profile-guided :class:`~zero_compile.profile.Plan` or None.
        profile: run graphs through the profiling interpreter (warm-up) instead of the inner compiler.
        debug_dir: where ``debug_log`` dumps each pass's graph, or None.
        on_compile: called with (graph id, kind, notes) after each graph is compiled (counts recompilations).
    """

    def __init__(self, store, param_index: dict[int, tuple[int, int]], passes: list[Pass], *, inner: str,
                 step: int, plan=None, profile: bool = False, debug_dir: str | None = None,
                 on_compile: Callable | None = None, stats=None):  # fmt: skip
        if inner not in INNER:
            raise ValueError(f"compile backend must be one of {INNER}, got {inner!r}")
        self.store, self.param_index, self.passes = store, param_index, passes
        self.inner, self.step, self.plan, self.profile = inner, step, plan, profile
        self.debug_dir, self.on_compile, self.stats = debug_dir, on_compile, stats
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph_id = self.graphs
        self.graphs += 1
        positions = {i: self.param_index[id(t)] for i, t in enumerate(example_inputs) if id(t) in self.param_index}
        shared: dict = {}

        def fw(g, ex):
            names = [n.name for n in g.graph.nodes if n.op == "placeholder"]
            shared["inputs"] = names
            shared["params"] = {names[i]: ut for i, ut in positions.items() if i < len(names)}
            return self._compile(g, ex, graph_id, "forward", shared)

        def bw(g, ex):
            return self._compile(g, ex, graph_id, "backward", shared)

        kwargs = {}
        if self.inner == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            kwargs["decompositions"] = select_decomp_table()
        aot = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=min_cut_rematerialization_partition,
                           keep_inference_input_mutations=True, **kwargs)  # fmt: skip
        return aot(gm, example_inputs)

    def _compile(self, gm: fx.GraphModule, example_inputs, graph_id: int, kind: str, shared: dict):
        ctx = PassContext(kind=kind, graph_id=graph_id, store=self.store.id, params=shared["params"],
                          inputs=shared["inputs"], step=self.step, plan=self.plan,
                          debug_dir=self.debug_dir)  # fmt: skip
        gm = run_passes(gm, ctx, self.passes)
        if self.on_compile is not None:
            self.on_compile(graph_id, kind, ctx.notes)
        if self.profile:
            store, stats = self.store, self.stats

            def run(args):
                interp = ProfilingInterpreter(gm, store, stats)
                out = interp.run(*args)
                args.clear()
                store.note_profile(interp.profile)
                return out

            run._boxed_call = True
            return run
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx_inner

            return compile_fx_inner(gm, example_inputs)
        return make_boxed_func(gm.forward)


def is_compiling() -> bool:
    """True inside Dynamo tracing (used to keep Python-side bookkeeping out of graphs)."""
    return torch.compiler.is_compiling()
