"""``zero.checkpointing``: activation recomputation for scripts written for ``deepspeed.checkpointing``.

zero implements only plain recomputation (the ``activation_checkpointing`` section with every option off), so this
is ``torch.utils.checkpoint`` with the non-reentrant implementation, which works with ZeRO-3's gather hooks (the
recomputed forward re-gathers the parameters it needs) and with inputs that do not require grad.
"""

from __future__ import annotations

import torch.utils.checkpoint


def checkpoint(function, *args, **kwargs):
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in backward.

    Mirrors ``deepspeed.checkpointing.checkpoint(function, *args)`` (without activation partitioning); returns what
    ``function`` returns. Keyword arguments go to ``function``.
    """
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def is_configured() -> bool:
    """DeepSpeed's query; zero needs no configuration step, so always True."""
    return True
