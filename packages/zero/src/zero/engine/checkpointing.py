"""Engine checkpoints through zero_core.checkpoint's sharded, resharding format (DeepSpeed's root layout)."""

from __future__ import annotations


def save(runtime, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config=None,
         save_latest: bool = True, exclude_frozen: bool = False) -> None:  # fmt: skip
    """Collective. Writes ``save_dir/tag`` and (unless ``save_latest`` is False) points ``save_dir/latest`` at it;
    ``exclude_frozen`` leaves out the frozen-only flat groups (zero_core's ``exclude_frozen_parameters``)."""
    from zero_core.checkpoint import save_checkpoint

    if hasattr(runtime, "save_checkpoint"):  # a runtime with its own format (the 1-bit optimizers' stage 0)
        return runtime.save_checkpoint(save_dir, tag, client_state, engine_state)

    save_checkpoint(runtime, save_dir, tag, client_state=client_state, extra_state=engine_state,
                    model_config=model_config, save_latest=save_latest,
                    exclude_frozen_parameters=exclude_frozen).wait()  # fmt: skip


def load(runtime, load_dir: str, tag: str | None, load_optimizer_states: bool, load_module_only: bool):
    """Returns ``(path, client_state, engine_state)``; zero_core's errors name a missing or corrupt file."""
    from zero_core.checkpoint import load_checkpoint

    if hasattr(runtime, "load_checkpoint"):
        return runtime.load_checkpoint(load_dir, tag, load_optimizer_states)

    res = load_checkpoint(runtime, load_dir, tag, load_optimizer_states=load_optimizer_states,
                          load_module_only=load_module_only)  # fmt: skip
    return str(res.path), res.client_state, res.extra_state
