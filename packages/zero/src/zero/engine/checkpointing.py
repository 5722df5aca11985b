"""Engine checkpoints through zero_core.checkpoint's sharded, resharding format (DeepSpeed's root layout); a model
AutoTP split writes one checkpoint per tensor-parallel rank plus the split (zero_core's ``save_split_checkpoint``)."""

from __future__ import annotations


def split_record(layout):
    """zero_core's ``SplitRecord`` of an AutoTP layout (``zero_parallel.TensorParallelLayout``), or None."""
    from zero_core.checkpoint import SplitParam, SplitRecord

    if layout is None:
        return None
    return SplitRecord(layout.size, {n: SplitParam(s.dim, tuple(s.full_shape), tuple(tuple(x) for x in s.sizes))
                                     for n, s in layout.shards.items()})  # fmt: skip


def save(runtime, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config=None,
         save_latest: bool = True, exclude_frozen: bool = False, split=None) -> None:  # fmt: skip
    """Collective. Writes ``save_dir/tag`` and (unless ``save_latest`` is False) points ``save_dir/latest`` at it;
    ``exclude_frozen`` leaves out the frozen-only flat groups (zero_core's ``exclude_frozen_parameters``);
    ``split``: the AutoTP layout of a split model (each tensor-parallel rank's checkpoint and the split recorded)."""
    from zero_core.checkpoint import save_checkpoint, save_split_checkpoint

    if hasattr(runtime, "save_checkpoint"):  # a runtime with its own format (the 1-bit optimizers' stage 0)
        return runtime.save_checkpoint(save_dir, tag, client_state, engine_state)
    kwargs = {"client_state": client_state, "extra_state": engine_state, "model_config": model_config,
              "save_latest": save_latest, "exclude_frozen_parameters": exclude_frozen}  # fmt: skip
    if split is not None:
        save_split_checkpoint(runtime, save_dir, tag, split_record(split), split.rank, **kwargs)
        return None
    save_checkpoint(runtime, save_dir, tag, **kwargs).wait()


def load(runtime, load_dir: str, tag: str | None, load_optimizer_states: bool, load_module_only: bool, split=None):
    """Returns ``(path, client_state, engine_state)``; zero_core's errors name a missing or corrupt file.
    ``split``: the AutoTP layout of a split model, or None; a checkpoint of any split (or none) loads either way."""
    from zero_core.checkpoint import load_split_checkpoint

    if hasattr(runtime, "load_checkpoint"):
        return runtime.load_checkpoint(load_dir, tag, load_optimizer_states)

    res = load_split_checkpoint(runtime, load_dir, tag, split_record(split), split.rank if split is not None else 0,
                                load_optimizer_states=load_optimizer_states,
                                load_module_only=load_module_only)  # fmt: skip
    return str(res.path), res.client_state, res.extra_state
