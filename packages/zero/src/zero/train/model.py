"""Llama model sizes for ``zero train`` (transformers ``LlamaForCausalLM`` built from a config; no download)."""

from __future__ import annotations

from zero.train.data import BOS, EOS, PAD, VOCAB

# name -> (hidden, layers, heads, intermediate). Parameter counts with the byte vocabulary (259), untied embeddings.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (64, 2, 4, 172),  # ~0.13M: tests
    "6m": (256, 7, 4, 688),  # ~5.6M
    "20m": (384, 11, 6, 1024),  # ~19.5M: the default
    "60m": (576, 14, 9, 1536),  # ~55M
    "120m": (768, 16, 12, 2048),  # ~114M
    "560m": (1536, 20, 12, 4096),  # ~567M: the big-model job (offload_param + offload_optimizer on NVMe)
}
DEFAULT_SIZE = "20m"


def llama_config(size: str, seq_len: int):
    """A ``transformers.LlamaConfig`` for ``size`` (see SIZES) with the byte vocabulary and ``seq_len`` context.

    Raises: ValueError naming the allowed sizes.
    """
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"--model-size {size!r} is not one of {', '.join(SIZES)}")
    hidden, layers, heads, inter = SIZES[size]
    return LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq_len,
                       bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, tie_word_embeddings=False,
                       attn_implementation="sdpa")  # fmt: skip


def build_model(size: str, seq_len: int, seed: int):
    """``LlamaForCausalLM`` with seeded random weights (fp32)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(size, seq_len))


def build_deferred(size: str, seq_len: int, seed: int):
    """The same architecture as ``build_model`` built on the meta device, with deferred parameters
    (``zero_core.defer_init``): no rank ever holds the whole model; stage 3 computes each unit's starting values
    when it materialises it. Values: LlamaForCausalLM's own init rule (normal, std ``initializer_range``, for
    linear and embedding weights; ones for RMSNorm weights), each drawn from a generator seeded by ``seed`` and
    the parameter's name, so they equal ``build_model``'s in distribution, not bitwise. Needs a process group."""
    import zlib

    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from zero_core import defer_init

    config = llama_config(size, seq_len)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffers are computed, not learned
    std = config.initializer_range

    def init(name: str, shape, dtype):
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=g, dtype=dtype) * std

    defer_init(model, init)
    return model
