"""Engine checkpoints through zero_core.checkpoint's sharded, resharding format (DeepSpeed's root layout); a model
AutoTP split writes one checkpoint per tensor-parallel rank plus the split (zero_core's ``save_split_checkpoint``).
Loads go through zero_core's format seam (``load_any_format``), which also reads DeepSpeed's own folders."""

from __future__ import annotations


def split_record(layout):
    """zero_core's ``SplitRecord`` of an AutoTP layout (``zero_parallel.TensorParallelLayout``), or None."""
    from zero_core.checkpoint import SplitParam, SplitRecord

    if layout is None:
        return None
    return SplitRecord(layout.size, {n: SplitParam(s.dim, tuple(s.full_shape), tuple(tuple(x) for x in s.sizes))
                                     for n, s in layout.shards.items()})  # fmt: skip


def group_names(model, optimizer) -> list[list[str]]:
    """Each optimizer param group's parameter names in the group's order (read before the runtime rebinds the
    groups to its master shards; DeepSpeed's layout follows it); empty without a torch optimizer."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in pg["params"] if id(p) in names] for pg in optimizer.param_groups]


class ZeroCoreCheckpoints:
    """:class:`~zero.engine.runtime_protocol.RuntimeCheckpoints` of a zero_core ``ZeroRuntime``.

    Args:
        runtime: the runtime.
        split: the AutoTP layout (``zero_parallel.TensorParallelLayout``) of a split model, or None: each
            tensor-parallel rank's checkpoint is written with the split recorded.
        fmt: ``checkpoint.format``: ``"zero"``, ``"deepspeed"`` (zero_core's ``save_deepspeed_checkpoint``) or
            ``"universal"`` (``save_universal_checkpoint``).
        param_order: :func:`group_names` of the model and optimizer, for the DeepSpeed layout.
    """

    def __init__(self, runtime, split=None, fmt: str = "zero", param_order: list[list[str]] | None = None):
        self.runtime, self.split, self.format = runtime, split, fmt
        self.param_order = param_order or []

    def save(self, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config: dict | None,
             save_latest: bool, exclude_frozen: bool) -> None:  # fmt: skip
        """Collective. Writes ``save_dir/tag`` and (unless ``save_latest`` is False) points ``save_dir/latest`` at
        it; ``exclude_frozen`` leaves out the frozen-only flat groups (zero_core's ``exclude_frozen_parameters``)."""
        from zero_core.checkpoint import save_checkpoint, save_split_checkpoint

        kwargs = {"client_state": client_state, "extra_state": engine_state, "model_config": model_config,
                  "save_latest": save_latest, "exclude_frozen_parameters": exclude_frozen}  # fmt: skip
        if self.format in ("deepspeed", "universal") and self.split is not None:
            from zero.config import NotSupportedError

            raise NotSupportedError(f"checkpoint.format '{self.format}' with tensor_parallel.autotp_size > 1: "
                                    "DeepSpeed's layouts hold data-parallel runs here; use 'zero'")  # fmt: skip
        if self.format == "universal":
            from zero_core.checkpoint.deepspeed_universal_write import save_universal_checkpoint

            save_universal_checkpoint(self.runtime, save_dir, tag, client_state=client_state, extra_state=engine_state,
                                      save_latest=save_latest, clip_grad=self.runtime.gradient_clipping,
                                      param_order=self.param_order)  # fmt: skip
            return
        if self.format == "deepspeed":
            from zero_core.checkpoint.deepspeed_write import save_deepspeed_checkpoint

            save_deepspeed_checkpoint(self.runtime, save_dir, tag, client_state=client_state, extra_state=engine_state,
                                      save_latest=save_latest, clip_grad=self.runtime.gradient_clipping,
                                      param_order=self.param_order,
                                      exclude_frozen_parameters=exclude_frozen,
                                      sub_group_size=self.runtime.config.sub_group_size)  # fmt: skip
            return
        if self.split is not None:
            save_split_checkpoint(self.runtime, save_dir, tag, split_record(self.split), self.split.rank, **kwargs)
            return
        save_checkpoint(self.runtime, save_dir, tag, **kwargs).wait()

    def load(self, load_dir: str, tag: str | None, load_optimizer_states: bool,
             load_module_only: bool) -> tuple[str, dict, dict]:  # fmt: skip
        """Returns ``(path, client_state, engine_state)``, ``path`` the model-states file DeepSpeed's
        ``load_checkpoint`` names (zero_core's ``loaded_model_file``); zero_core's errors name a missing or corrupt
        file. A checkpoint of any split (or none) loads into a model of any split (or none). The folder may be zero's
        or DeepSpeed 0.19's ZeRO stage 0-3 or universal layout (zero_core's ``FORMATS`` recognise it)."""
        import torch.distributed as dist

        from zero_core.checkpoint import load_any_format, loaded_model_file

        rank = self.split.rank if self.split is not None else 0
        res = load_any_format(self.runtime, load_dir, tag, split_record(self.split), rank, self.param_order,
                              load_optimizer_states=load_optimizer_states,
                              load_module_only=load_module_only)  # fmt: skip
        dp_rank = dist.get_rank(self.runtime.group) if dist.is_initialized() else 0
        path = loaded_model_file(load_dir, res.path, self.runtime.stage, dp_rank)
        return path, res.client_state, res.extra_state
