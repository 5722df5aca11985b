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
