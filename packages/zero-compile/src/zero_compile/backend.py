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

from zero_compile import ops
from zero_compile.passes.base import Pass, PassContext, run_passes
from zero_compile.profile import ProfilingInterpreter

INNER = ("aot_eager", "inductor")


class ZeroBackend:
    """A Dynamo backend applying ``passes`` to every captured graph.

    Args:
        store: the :class:`~zero_compile.store.UnitStore`; its ``locate`` tells the parameters the passes rewrite
            (their unit and slot) from other inputs.
        passes: the pass list of this phase.
        inner: "aot_eager" (run the FX graphs as Python) or "inductor".
        step: the optimizer step this phase starts at (names debug dumps).
        plan: the profile-guided :class:`~zero_compile.profile.Plan` or None.
        profile: run graphs through the profiling interpreter (warm-up) instead of the inner compiler.
        debug_dir: where ``debug_log`` dumps each pass's graph, or None.
        on_compile: called with (graph id, kind, notes) after each graph is compiled (counts recompilations).
        joint_passes: with inductor, run inductor's joint-graph passes before the partition, as ``torch.compile``
            does (False: the plain min-cut partition).
    """

    def __init__(self, store, passes: list[Pass], *, inner: str,
                 step: int, plan=None, profile: bool = False, debug_dir: str | None = None,
                 on_compile: Callable | None = None, stats=None, joint_passes: bool = True):  # fmt: skip
        if inner not in INNER:
            raise ValueError(f"compile backend must be one of {INNER}, got {inner!r}")
        self.store, self.passes = store, passes
        self.inner, self.step, self.plan, self.profile = inner, step, plan, profile
        self.debug_dir, self.on_compile, self.stats = debug_dir, on_compile, stats
        self.joint_passes = joint_passes
        self.graphs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph_id = self.graphs
        self.graphs += 1
        # AOTAutograd's primals: the graph module's parameters and buffers, then Dynamo's inputs, with repeated
        # tensors (tied weights) kept once, at their first position
        flat = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
                *dict(gm.named_buffers(remove_duplicate=False)).values(), *example_inputs]  # fmt: skip
        seen: set[int] = set()
        primals = [t for t in flat if not (isinstance(t, torch.Tensor) and (id(t) in seen or seen.add(id(t))))]
        shared: dict = {}

        def partition(joint, joint_inputs, *, num_fwd_outputs, **kw):
            _anchor_param_grads(joint, primals, self.store, num_fwd_outputs)
            if self.inner == "inductor" and self.joint_passes:
                # inductor's own partition: its joint-graph passes (pattern rewrites, no-op removal), then min-cut
                from torch._inductor.compile_fx import partition_fn

                return partition_fn(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
            return min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

        def fw(g, ex):
            names = [n.name for n in g.graph.nodes if n.op == "placeholder"]
            if len(names) != len(primals):
                raise RuntimeError(f"zero_compile: graph {graph_id} has {len(names)} inputs but {len(primals)} "
                                   "primals were expected; cannot tell which inputs are parameters")  # fmt: skip
            shared["inputs"] = names
            found = [(n, self.store.locate(t)) for n, t in zip(names, primals)]
            shared["params"] = {n: where for n, where in found if where is not None}
            return self._compile(g, ex, graph_id, "forward", shared)

        def bw(g, ex):
            return self._compile(g, ex, graph_id, "backward", shared)

        kwargs = {}
        if self.inner == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            kwargs["decompositions"] = select_decomp_table()
        aot = aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=partition,
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


def _anchor_param_grads(joint: fx.GraphModule, primals: list, store, num_fwd_outputs: int) -> None:
    """Wrap every parameter gradient the joint graph returns in ``grad_anchor(grad, param)``, so the partitioner
    saves the parameter (an empty placeholder, free) and the backward passes can tell which unit it belongs to."""
    graph = joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    flat = list(out.args[0])
    for i, g in enumerate(flat[num_fwd_outputs:]):
        if g is None or i >= len(placeholders) or store.locate(primals[i]) is None:
            continue
        with graph.inserting_before(out):
            flat[num_fwd_outputs + i] = graph.call_function(ops.GRAD_ANCHOR, (g, placeholders[i]))
            flat[num_fwd_outputs + i].meta["val"] = g.meta.get("val")
    out.args = (type(out.args[0])(flat),) + tuple(out.args[1:])
    joint.recompile()


def is_compiling() -> bool:
    """True inside Dynamo tracing (used to keep Python-side bookkeeping out of graphs)."""
    return torch.compiler.is_compiling()
