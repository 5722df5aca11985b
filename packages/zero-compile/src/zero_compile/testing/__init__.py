"""Helpers for tests of the compiled path: a self-contained :class:`LocalShards` source (no core needed) and a
small transformer with odd sizes (every unit padded at 2 and 3 ranks), optionally with graph breaks."""

from zero_compile.testing.local import LocalShards
from zero_compile.testing.models import TinyTransformer, batches

__all__ = ["LocalShards", "TinyTransformer", "batches"]
