"""Activation checkpointing: recompute a segment in backward instead of keeping its activations.

* :mod:`~zero.activation_checkpointing.api`: ``configure`` / ``checkpoint`` with DeepSpeed's interface
  (``deepspeed.checkpointing``), the config's `activation_checkpointing` section;
* :mod:`~zero.activation_checkpointing.store`: how a segment's inputs are kept between forward and recompute
  (partitioned, in host memory, in contiguous buffers);
* :mod:`~zero.activation_checkpointing.offload`: the inputs of transformers' gradient-checkpointed layers kept in
  host memory (Arctic Long Sequence Training; ``deepspeed.runtime.activation_checkpointing.offload_activations``).

Not to be confused with :mod:`zero.engine.checkpoint_io` (the engine's save/load) or
:mod:`zero.checkpoint_tools` (consolidating saved checkpoints).
"""
