"""Stage-3 partitioning with DeepSpeed's signatures over zero_core: ``Init`` (partition a model as it is built) in
:mod:`zero.partitioning.init`, ``GatheredParameters`` and ``register_external_parameter`` in
:mod:`zero.partitioning.gathered`. ``import zero as deepspeed`` serves them as ``deepspeed.zero``."""
