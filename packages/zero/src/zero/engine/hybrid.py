"""``HybridEngine``: DeepSpeed 0.19.8's ``DeepSpeedHybridEngine``, a training engine that also generates (RLHF).

``initialize()`` returns it when the config's ``hybrid_engine.enabled`` is true. Training is the
:class:`~zero.engine.Engine`'s, untouched: ``generate`` works on a copy, so the parameters, optimizer state and
gradients after N steps are the same with or without rollouts between them.

``generate(*inputs, **kwargs)`` (transformers' arguments; collective: every rank of the engine calls it together):

* ``pin_parameters`` true (DeepSpeed's default: gather all layers once per rollout): the current weights are
  gathered into an inference copy (:func:`~zero.engine.hybrid_copy.gathered_copy`, ``tp_gather_partition_size``
  decoder layers per gather) wrapped in zero_inference's :class:`~zero_inference.InferenceEngine`, with
  ``replace_with_kernel_inject`` (fused decoder blocks and a static KV cache) where zero_inference has a fused block
  for the model's layers, else the model's own ``generate``; the copy is dropped after the rollout.
* ``inference_tp_size`` > 1: the copy is split over consecutive blocks of that many ranks (AutoTP); as in
  DeepSpeed each rank's prompts (``input_ids`` and ``attention_mask``, the same shape on every rank of the block)
  are all-gathered, the block generates for all of them and each rank returns its own rows.
* ``pin_parameters`` false: the training module generates itself, its stage-3 hooks gathering each module's
  parameters in every forward (less memory, one all-gather per module per token).
* ``release_inference_cache``: after the rollout the freed memory is returned (garbage collection and the CUDA
  cache emptied); ``max_out_tokens``: a prompt longer than it is refused (the inference engine's check).
* ``enable_cuda_graph``: accepted; zero captures no CUDA graphs (DeepSpeed also runs without them where they are
  unsupported, with a warning, as zero does at construction).

Errors, raised on every rank: ``generate`` called on some ranks only (:class:`PartialRolloutError` after
``rollout_timeout`` seconds instead of a hang); an argument error on one rank (zero_inference's checks); prompts of
different shapes within an ``inference_tp_size`` block (ValueError); at construction an ``inference_tp_size`` that
does not divide the world size (ValueError).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from zero.engine.engine import Engine
from zero.engine.hybrid_copy import ConfiguredModel, gathered_copy
from zero.log import logger
from zero_comm import AgreementTimeout, agree, broadcast
from zero_inference import DEFAULT_SYNC_TIMEOUT, DeepSpeedInferenceConfig, InferenceEngine, has_fused_blocks


class PartialRolloutError(TimeoutError):
    """``HybridEngine.generate`` was called on some ranks only: ``missing`` (ranks) did not call it within
    ``rollout_timeout`` seconds. Every rank must call ``generate`` together (the weights are gathered from all)."""

    def __init__(self, missing: list[int] | None, timeout: float):
        self.missing = missing
        who = f"ranks {missing}" if missing else "some ranks"
        super().__init__(f"HybridEngine.generate: {who} did not call generate within {timeout:.1f} s; every rank "
                         "must call generate together (the rollout gathers the weights from every rank)")  # fmt: skip


class HybridEngine(Engine):
    """The training :class:`~zero.engine.Engine` plus ``generate`` (see the module docstring).

    Attributes:
        inference_group: the ``inference_tp_size`` block of this rank (None when it is 1).
        rollout_timeout: seconds ``generate`` waits for the other ranks (zero_inference's default).
    """

    def __init__(self, built, config, **kwargs):
        super().__init__(built, config, **kwargs)
        section = config.hybrid_engine
        self.inference_group = None
        self.rollout_timeout = DEFAULT_SYNC_TIMEOUT
        tp = section.inference_tp_size
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % tp:
            raise ValueError(f"hybrid_engine.inference_tp_size {tp} does not divide the world size {world}: each "
                             f"block of {tp} consecutive ranks generates with one split copy")  # fmt: skip
        if tp > 1:
            rank = dist.get_rank()
            for start in range(0, world, tp):  # every rank takes part in creating every block's group
                group = dist.new_group(list(range(start, start + tp)))
                if start <= rank < start + tp:
                    self.inference_group = group
        if section.enable_cuda_graph:
            logger.warning("hybrid_engine.enable_cuda_graph: zero captures no CUDA graphs; generating without them")
        if world > 1:  # DeepSpeed gives every rank rank 0's generator state (sampled rollouts then agree)
            if torch.cuda.is_available():
                state = torch.cuda.get_rng_state().to(torch.cuda.current_device())
                broadcast(state, 0)
                torch.cuda.set_rng_state(state.cpu())
            else:
                state = torch.get_rng_state()
                broadcast(state, 0)
                torch.set_rng_state(state)

    def generate(self, *inputs, **kwargs):
        """Tokens ``[batch, prompt + new]`` for this rank's prompts, generated with the current weights.

        Raises:
            PartialRolloutError: the other ranks did not call ``generate`` within ``rollout_timeout``.
            ValueError: prompts of different shapes within an ``inference_tp_size`` block.
            TypeError: ``pin_parameters`` with a module that is not a transformers model (no ``config`` /
                ``generate``).
            zero_comm.GroupOperationError: one of zero_inference's argument errors on any rank.
        """
        section = self.config.hybrid_engine
        error = None if isinstance(self.module, ConfiguredModel) or not section.pin_parameters else TypeError(
            f"HybridEngine.generate: {type(self.module).__name__} is not a transformers model (it needs config and "
            "generate); build it with from_config / from_pretrained")  # fmt: skip
        if dist.is_initialized():
            try:
                agree("HybridEngine.generate", error, timeout=self.rollout_timeout)
            except AgreementTimeout as e:
                raise PartialRolloutError(e.missing, self.rollout_timeout) from e
        elif error is not None:
            raise error
        if not section.pin_parameters:
            with torch.no_grad():
                return self.module.generate(*inputs, **kwargs)
        rows = None
        if self.inference_group is not None:
            inputs, kwargs, rows = self._gather_prompts(inputs, kwargs)
        copy = gathered_copy(self.module, section.tp_gather_partition_size)
        dtype = next(copy.parameters()).dtype
        engine = InferenceEngine(copy, DeepSpeedInferenceConfig(
            dtype=dtype, max_out_tokens=section.max_out_tokens, replace_with_kernel_inject=has_fused_blocks(copy),
            tensor_parallel={"tp_size": section.inference_tp_size, "tp_group": self.inference_group}))  # fmt: skip
        engine.sync_timeout = self.rollout_timeout
        with torch.no_grad():
            out = engine.generate(*inputs, **kwargs)
        del engine, copy
        if rows is not None:
            out = out[rows]
        if section.release_inference_cache:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return out

    def _gather_prompts(self, inputs: tuple, kwargs: dict):
        """The block's prompts concatenated on the batch dimension, and this rank's rows of the result."""
        ids = inputs[0] if inputs else kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        shapes = [None] * dist.get_world_size(self.inference_group)
        dist.all_gather_object(shapes, (tuple(ids.shape), None if mask is None else tuple(mask.shape)),
                               group=self.inference_group)  # fmt: skip
        if len(set(shapes)) > 1:
            raise ValueError(f"HybridEngine.generate with hybrid_engine.inference_tp_size > 1: the ranks of a block "
                             f"give prompts of shapes {shapes} (input_ids, attention_mask); give the same shape on "
                             "each (pad to one length)")  # fmt: skip
        rank = dist.get_rank(self.inference_group)
        size = dist.get_world_size(self.inference_group)

        def gather(t: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=self.inference_group)
            return torch.cat(parts)

        if inputs:
            inputs = (gather(ids), *inputs[1:])
        else:
            kwargs = {**kwargs, "input_ids": gather(ids)}
        if mask is not None:
            kwargs = {**kwargs, "attention_mask": gather(mask)}
        batch = ids.shape[0]
        return inputs, kwargs, slice(rank * batch, (rank + 1) * batch)
