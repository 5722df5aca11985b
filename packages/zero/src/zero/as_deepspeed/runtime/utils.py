"""``deepspeed.runtime.utils``: ``move_to_device`` and ``noop_context`` (``zero.nested_tensors``)."""

from zero.nested_tensors import move_to_device, noop_context

__all__ = ["move_to_device", "noop_context"]
