"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save`` (``zero.checkpoint_tools.torch_save``)."""

from zero.checkpoint_tools.torch_save import clone_tensors_for_torch_save

__all__ = ["clone_tensors_for_torch_save"]
