"""Ulysses sequence parallelism for Hugging Face models: each rank of the sequence-parallel group holds a shard of
every sequence; around the core attention, two all-to-alls trade it for all of the sequence and a share of heads.

Mirrors DeepSpeed 0.19.8's ``UlyssesSPAttentionHF`` (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``), as
Hugging Face Accelerate drives it: ``register_with_transformers(...)`` puts the adapter in front of the model's
core attention function (in transformers' ``AttentionInterface``, under the same key, so every code path that
checks ``config._attn_implementation`` still runs) and returns the mpu.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from zero_comm import all_gather_into_tensor
from zero_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from zero_parallel.mesh import SequenceParallelMPU

CORE_IMPLEMENTATIONS = ("sdpa", "flex_attention")
"""Core attention implementations the adapter wraps (transformers' ``attn_implementation`` keys)."""
REFUSED_IMPLEMENTATIONS = ("eager", "paged|eager")
"""Refused: eager attention needs the full [s, s] mask of each sequence, which sequence sharding discards."""

# transformers' own function per wrapped key, kept from the first registration so that registering again (a new
# model, another size) wraps the core function rather than a previous adapter.
_CORE_FUNCTIONS: dict[str, Callable] = {}


class UlyssesSPAttentionHF(torch.nn.Module):
    """Sequence-parallel attention in transformers' attention-function form.

    ``forward(module, query, key, value, attention_mask, **kwargs)`` takes this rank's sequence shard,
    ``query`` ``[b, h, s/sp, d]`` and ``key``/``value`` ``[b, kv, s/sp, d]`` (any float dtype), and returns
    ``(out, weights)`` with ``out`` ``[b, s/sp, h, d]`` (what transformers' attention functions return) equal to this
    shard's rows of the full-sequence attention. Inside: all-to-all to ``[b, h/sp, s, d]``, ``attn`` (the core
    attention function), all-to-all back. Sequence ranks hold consecutive shards (rank ``i``: positions
    ``[i*s/sp, (i+1)*s/sp)``), every rank of the group the same shard length.

    When ``sp`` exceeds ``kv`` (grouped-query attention with few KV heads), each KV head is repeated ``sp/kv``
    times before the exchange so that each rank gets the one KV head its query heads use, and the module's
    ``num_key_value_groups`` is set to the local ratio for the call.

    Args (DeepSpeed's names):
        attn: the core attention function, ``attn(module, q, k, v, mask, **kwargs) -> (out, weights)``.
        batch_size: micro-batch size every call must have.
        attn_head_count, attn_head_size, kv_head_count: the model's heads ``h``, head size ``d``, KV heads ``kv``.
        num_hidden_layers: the model's layers (kept for DeepSpeed's signature).
        process_group: the sequence-parallel group.
        seq_length_is_variable: the sequence length may change between batches; when False every call must
            have ``local_seq_length`` positions per rank.
        local_seq_length, global_seq_length: the fixed lengths (``seq_length_is_variable=False``).
        disable_in_eval: when the module is in eval mode, call ``attn`` directly on the local tensors.

    Raises:
        ValueError: ``attn_head_count`` not divisible by the group size; ``kv_head_count`` and the group size not
            dividing one another; fixed lengths missing or inconsistent.
    """

    def __init__(
        self,
        attn: Callable,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size = batch_size
        self.attn_head_count = attn_head_count
        self.attn_head_size = attn_head_size
        self.kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None  # the transformers key it wraps; set on registration
        self._block_mask_cache: tuple | None = None  # flex_attention: ((s, device), BlockMask) of the last call
        sp = self.world_size
        if attn_head_count % sp:
            raise ValueError(f"attn_head_count={attn_head_count} is not divisible by the sequence-parallel size {sp}")
        if kv_head_count % sp and sp % kv_head_count:
            raise ValueError(
                f"kv_head_count={kv_head_count} and the sequence-parallel size {sp} must divide one another "
                "(KV heads are split across the group, or repeated when there are fewer of them than ranks)"
            )
        # Repeat each KV head so that every rank gets exactly the one its query heads attend with.
        self.kv_replication = sp // kv_head_count if sp > kv_head_count else 1
        self.local_q_heads = attn_head_count // sp
        self.local_kv_heads = kv_head_count * self.kv_replication // sp
        if not seq_length_is_variable:
            if local_seq_length is None or global_seq_length is None:
                raise ValueError("seq_length_is_variable=False needs local_seq_length and global_seq_length")
            if local_seq_length * sp != global_seq_length:
                raise ValueError(
                    f"global_seq_length={global_seq_length} must be local_seq_length={local_seq_length} x the "
                    f"sequence-parallel size {sp}"
                )

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        b, s_local, d = self.batch_size, query.shape[2], self.attn_head_size
        want_q = (b, self.attn_head_count, s_local, d)
        want_kv = (b, self.kv_head_count, s_local, d)
        if query.dim() != 4 or tuple(query.shape) != want_q:
            raise ValueError(f"query must be [batch, heads, seq shard, head_dim] = {want_q}, got {tuple(query.shape)}")
        for name, t in (("key", key), ("value", value)):
            if tuple(t.shape) != want_kv:
                raise ValueError(f"{name} must be [batch, kv heads, seq shard, head_dim] = {want_kv}, got "
                                 f"{tuple(t.shape)}")  # fmt: skip
        if not self.seq_length_is_variable and s_local != self.local_seq_length:
            raise ValueError(
                f"this rank's sequence shard has {s_local} positions, but seq_length={self.global_seq_length} was "
                f"registered as fixed ({self.local_seq_length} per rank); register with seq_length_is_variable=True"
            )

    def _gather_position_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[b, s/sp] of each rank -> [b, s]: attention backends that read positions (packed sequences) see the
        whole sequence."""
        sp = self.world_size
        local = position_ids.contiguous()
        out = torch.empty(sp * local.numel(), dtype=local.dtype, device=local.device)
        all_gather_into_tensor(out, local.reshape(-1), self.process_group)
        out = out.view(sp, *local.shape)  # chunk i: rank i's positions
        return out.transpose(0, 1).reshape(local.shape[0], -1, *local.shape[2:])

    def _full_sequence_mask(self, seq_len: int, device: torch.device):
        """The mask the core attention gets after the exchange: none for sdpa (causal by ``is_causal``); for
        flex_attention, a causal ``BlockMask`` over the whole sequence in place of the shard's."""
        if self.core_attn_implementation != "flex_attention":
            return None
        from torch.nn.attention.flex_attention import create_block_mask

        key = (seq_len, device)
        if self._block_mask_cache is None or self._block_mask_cache[0] != key:

            def causal(batch, head, q_idx, kv_idx):
                return q_idx >= kv_idx

            mask = create_block_mask(causal, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=device)
            self._block_mask_cache = (key, mask)
        return self._block_mask_cache[1]

    def forward(self, module: torch.nn.Module, query, key, value, attention_mask, *args, **kwargs):
        """See the class docstring. ``attention_mask``: the shard's mask is dropped (causal attention over the
        whole sequence is what the core computes; padding is not supported, pack sequences instead).
        ``position_ids`` in ``kwargs`` (``[b, s/sp]``) are all-gathered to ``[b, s]``."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_inputs(query, key, value)
        group = self.process_group
        if self.kv_replication > 1:
            key = key.repeat_interleave(self.kv_replication, dim=1)
            value = value.repeat_interleave(self.kv_replication, dim=1)
        # [b, h, s_l, d] -> [b, s_l, h, d] -> exchange -> [b, s, h_l, d] -> [b, h_l, s, d]
        q = sequence_to_heads(query.transpose(1, 2), group).transpose(1, 2)
        k = sequence_to_heads(key.transpose(1, 2), group).transpose(1, 2)
        v = sequence_to_heads(value.transpose(1, 2), group).transpose(1, 2)
        if isinstance(kwargs.get("position_ids"), torch.Tensor):
            kwargs["position_ids"] = self._gather_position_ids(kwargs["position_ids"])
        mask = self._full_sequence_mask(q.shape[2], q.device)
        groups_before = module.num_key_value_groups if self.kv_replication > 1 else None
        if groups_before is not None:
            module.num_key_value_groups = self.local_q_heads // self.local_kv_heads
        try:
            out, weights = self.attn(module, q, k, v, mask, *args, **kwargs)  # out: [b, s, h_l, d]
        finally:
            if groups_before is not None:
                module.num_key_value_groups = groups_before
        return heads_to_sequence(out, group), weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> SequenceParallelMPU | None:
        """Put an adapter in front of transformers' ``core_attn_implementation`` and return the mpu.

        Builds the (dp, sp) mesh over the whole default process group (:class:`SequenceParallelMPU`), reads the
        model's heads from its config, and registers the adapter in ``AttentionInterface`` under
        ``core_attn_implementation``: every model of this process that uses that implementation then runs
        sequence-parallel. ``sequence_parallel_size == 1`` does nothing and returns None (DeepSpeed's behaviour).

        Args:
            model_name_or_path: a loaded ``PreTrainedModel``, a ``PretrainedConfig``, or a hub name / local path
                (its config is read with ``AutoConfig.from_pretrained``).
            core_attn_implementation: ``"sdpa"`` or ``"flex_attention"``; for a loaded model it must equal the
                model's ``config._attn_implementation``.
            sequence_parallel_size: ranks sharing one sequence; divides the world size.
            micro_batch_size: the batch size of every forward.
            seq_length: the global sequence length when it is fixed (``seq_length_is_variable=False``).
            seq_length_is_variable: whether the sequence length may change between batches.
            disable_in_eval: run the core attention directly (no exchange) while the model is in eval mode.
            max_length: DeepSpeed's deprecated name for ``seq_length``.

        Returns:
            the :class:`SequenceParallelMPU`, or None when ``sequence_parallel_size`` is 1.

        Raises:
            ValueError: ``core_attn_implementation`` is eager or unknown, or differs from the loaded model's;
                ``seq_length`` missing, or not divisible by ``sequence_parallel_size``, when fixed; sizes that do
                not divide (see :func:`~zero_parallel.mesh.init_parallel_mesh` and the class).
            TypeError: ``model_name_or_path`` is none of the accepted kinds.
        """
        if sequence_parallel_size == 1:
            return None
        from transformers import AttentionInterface, AutoConfig, PretrainedConfig, PreTrainedModel
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if core_attn_implementation in REFUSED_IMPLEMENTATIONS:
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} is not supported by Ulysses sequence "
                f"parallelism: it needs each sequence's full attention mask. Use one of {CORE_IMPLEMENTATIONS}"
            )
        if core_attn_implementation not in CORE_IMPLEMENTATIONS:
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r} is not one of {CORE_IMPLEMENTATIONS}"
            )
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("seq_length is required when seq_length_is_variable=False (the fixed global length)")
        if isinstance(model_name_or_path, PreTrainedModel):
            config = model_name_or_path.config
            loaded = config._attn_implementation
            if loaded != core_attn_implementation:
                raise ValueError(
                    f"core_attn_implementation={core_attn_implementation!r} differs from the model's "
                    f"attn_implementation {loaded!r}: load the model with the same implementation"
                )
        elif isinstance(model_name_or_path, PretrainedConfig):
            config = model_name_or_path
        elif isinstance(model_name_or_path, (str, os.PathLike)):
            config = AutoConfig.from_pretrained(model_name_or_path)
        else:
            raise TypeError(
                "model_name_or_path must be a PreTrainedModel, a PretrainedConfig or a model name/path, got "
                f"{type(model_name_or_path).__name__}"
            )
        mpu = SequenceParallelMPU.build(sequence_parallel_size)
        sp = mpu.get_sequence_parallel_world_size()
        if not seq_length_is_variable and seq_length % sp:
            raise ValueError(f"seq_length={seq_length} is not divisible by sequence_parallel_size={sp}")
        text = config.get_text_config()
        heads = text.num_attention_heads
        head_size = getattr(text, "head_dim", None) or text.hidden_size // heads  # not every config declares it
        adapter = cls(
            attn=_CORE_FUNCTIONS.setdefault(
                core_attn_implementation, ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
            ),
            batch_size=micro_batch_size,
            attn_head_count=heads,
            attn_head_size=head_size,
            kv_head_count=text.num_key_value_heads,
            num_hidden_layers=text.num_hidden_layers,
            process_group=mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=None if seq_length_is_variable else seq_length // sp,
            global_seq_length=None if seq_length_is_variable else seq_length,
            disable_in_eval=disable_in_eval,
        )
        adapter.core_attn_implementation = core_attn_implementation
        AttentionInterface.register(core_attn_implementation, adapter)
        return mpu


def unregister_from_transformers(core_attn_implementation: str) -> None:
    """Give ``core_attn_implementation`` its transformers function back (undoes every
    ``register_with_transformers`` for it); nothing happens if it was never wrapped."""
    core = _CORE_FUNCTIONS.pop(core_attn_implementation, None)
    if core is not None:
        from transformers import AttentionInterface

        AttentionInterface.register(core_attn_implementation, core)
