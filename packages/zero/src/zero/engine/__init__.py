"""The Engine and what it composes (runtime choice, dataloader, checkpoint glue)."""

from zero.engine.engine import Engine

__all__ = ["Engine"]
