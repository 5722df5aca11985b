"""Tools over saved checkpoints, outside the engine.

* :mod:`~zero.checkpoint_tools.to_fp32`: consolidate a sharded checkpoint into one fp32 state dict (DeepSpeed's
  ``zero_to_fp32`` functions; the standalone ``zero_to_fp32.py`` script copied beside checkpoints is zero_core's);
* :mod:`~zero.checkpoint_tools.torch_save`: ``clone_tensors_for_torch_save`` (DeepSpeed's
  ``deepspeed.checkpoint.utils``), copies that ``torch.save`` writes compactly.

The checkpoint format itself is ``zero_core.checkpoint``; the engine's save/load is :mod:`zero.engine.checkpoint_io`.
"""
