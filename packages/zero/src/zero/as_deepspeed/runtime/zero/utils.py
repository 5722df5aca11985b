"""``deepspeed.runtime.zero.utils``: ``get_mapping_to_flat_buffer`` (``zero.engine.optimizer_kinds``)."""

from zero.engine.optimizer_kinds import get_mapping_to_flat_buffer

__all__ = ["get_mapping_to_flat_buffer"]
