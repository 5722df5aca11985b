"""``Engine.destroy()`` (DeepSpeed's ``engine.destroy()``): detach the runtime, leaving a plain module."""

from __future__ import annotations


class LifecycleMixin:
    """Mixed into ``zero.engine.Engine``; expects ``runtime``, ``observer``, ``mpu`` and ``tp_groups`` on self."""

    def destroy(self) -> None:
        """Collective (stage 3 gathers each unit once). Every hook zero installed is removed and ``module`` keeps
        plain dense parameters holding the trained values, so it can be used, saved or wrapped again; the
        engine cannot train afterwards. Idempotent.
        ``deepspeed.utils.groups`` stops answering from this engine's sequence-parallel mpu and AutoTP mesh; AutoTP's
        layers run their own collectives again (the ``autotp`` compile pass had left them to its graph)."""
        from zero import parallel_groups as groups

        if self.mpu is not None and groups.mpu is self.mpu:
            groups.mpu = None
        if self.tp_groups is not None and groups.tensor_parallel is self.tp_groups:
            groups.tensor_parallel = None
        self.runtime.close()
        from zero.engine.expert_parallel import ExpertParallel

        if isinstance(self.runtime.model_parallel, ExpertParallel):  # the MoE gradient hooks go too
            self.runtime.model_parallel.close()
        from zero_parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

        for layer in self.module.modules():  # the autotp pass's graph is gone: the layers run their own collectives
            if isinstance(layer, ColumnParallelLinear | RowParallelLinear):
                layer.collectives_in_graph = False
        if self.observer is not None:
            self.observer.close()
