"""Several runs of one job script in one launch: one process start-up (torch, transformers, Accelerate imports)
instead of one per run. Used by the scripts of this folder; their MODES argument is comma-separated."""

from __future__ import annotations

from collections.abc import Callable


def run_modes(main: Callable[[str, str], None], out: str, modes: str) -> None:
    """Run ``main(out, mode)`` for each of the comma-separated ``modes``, each from a fresh Accelerate state (as in
    a launch of its own: process, accelerator and gradient-accumulation state reset). transformers and Accelerate
    keep a DeepSpeed config process-wide once one is configured (``is_deepspeed_zero3_enabled``,
    ``ACCELERATE_USE_DEEPSPEED``), so the DDP reference must come first.

    Raises ValueError when ``ddp`` follows a DeepSpeed mode."""
    from accelerate.state import AcceleratorState, GradientState

    names = modes.split(",")
    if "ddp" in names[1:]:
        raise ValueError(f"modes {modes!r}: ddp must be the first, before any DeepSpeed config is set")
    for mode in names:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        main(out, mode)
