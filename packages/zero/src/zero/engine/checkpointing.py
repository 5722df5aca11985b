"""Engine checkpoints through zero_core.checkpoint's sharded, resharding format (DeepSpeed's root layout)."""

from __future__ import annotations


class ZeroCoreCheckpoints:
    """:class:`~zero.engine.runtime_protocol.RuntimeCheckpoints` of a zero_core ``ZeroRuntime``."""

    def __init__(self, runtime):
        self.runtime = runtime

    def save(self, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config: dict | None,
             save_latest: bool, exclude_frozen: bool) -> None:  # fmt: skip
        """Collective. Writes ``save_dir/tag`` and (unless ``save_latest`` is False) points ``save_dir/latest`` at
        it; ``exclude_frozen`` leaves out the frozen-only flat groups (zero_core's ``exclude_frozen_parameters``)."""
        from zero_core.checkpoint import save_checkpoint

        save_checkpoint(self.runtime, save_dir, tag, client_state=client_state, extra_state=engine_state,
                        model_config=model_config, save_latest=save_latest,
                        exclude_frozen_parameters=exclude_frozen).wait()  # fmt: skip

    def load(self, load_dir: str, tag: str | None, load_optimizer_states: bool,
             load_module_only: bool) -> tuple[str, dict, dict]:  # fmt: skip
        """Returns ``(path, client_state, engine_state)``; zero_core's errors name a missing or corrupt file."""
        from zero_core.checkpoint import load_checkpoint

        res = load_checkpoint(self.runtime, load_dir, tag, load_optimizer_states=load_optimizer_states,
                              load_module_only=load_module_only)  # fmt: skip
        return str(res.path), res.client_state, res.extra_state
