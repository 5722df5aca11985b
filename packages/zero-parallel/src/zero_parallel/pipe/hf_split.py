"""A Hugging Face decoder-only causal LM (Llama, Qwen2, Qwen3, Mistral: ``model.model.embed_tokens``,
``model.model.layers``, ``model.model.norm``, ``model.model.rotary_emb``, ``model.lm_head``) as a layer list for
:class:`~zero_parallel.pipe.PipelineModule`, as torchtitan's pipeline split cuts such a model: the token
embedding, one layer per decoder layer, the final norm, the LM head; the user writes no LayerSpec.

Between stages the activation is the hidden states ``[batch, seq, hidden]``; each decoder layer recomputes the
rotary position embeddings of positions ``0 .. seq - 1`` (the model's own rotary module, a copy per layer: it
holds no parameters) and runs causally: under SDPA with no mask (its ``is_causal`` path, as the model's forward
takes for an unpadded batch), under eager attention with the additive causal mask the model builds (the dtype's
minimum above the diagonal). With ``config.tie_word_embeddings`` the embedding and the head are one
:class:`~zero_parallel.pipe.TiedLayerSpec` (key ``"embed"``), their gradients summed over the stages holding them.
The loss, :func:`causal_lm_loss`, is the model's own (labels shifted left, ``-100`` ignored, mean over tokens).
Inputs are the token ids ``[batch, seq]`` (int64); no padding mask, no KV cache.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from zero_parallel.pipe.module import TiedLayerSpec

IGNORE_INDEX = -100
"""Label positions the loss leaves out (transformers' ``ignore_index``)."""


class DecoderLayerStage(nn.Module):
    """One decoder layer run on hidden states alone: position embeddings and the causal mask made here.

    Args:
        layer: the model's decoder layer (called as the model's forward calls it).
        rotary: a copy of the model's rotary embedding module (``rotary(hidden, position_ids) -> (cos, sin)``).
        eager_mask: build the additive causal mask (eager attention); False: no mask (SDPA's causal path).
    """

    def __init__(self, layer: nn.Module, rotary: nn.Module, eager_mask: bool) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.eager_mask = eager_mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[batch, seq, hidden]`` -> the layer's output, same shape and dtype."""
        seq = hidden.shape[1]
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary(hidden, position_ids=position_ids)
        mask = None
        if self.eager_mask:
            low = torch.finfo(hidden.dtype).min
            mask = torch.full((seq, seq), low, dtype=hidden.dtype, device=hidden.device).triu(1)
            mask = mask[None, None].expand(hidden.shape[0], 1, seq, seq)
        out = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                         position_embeddings=position_embeddings)  # fmt: skip
        return out[0] if isinstance(out, tuple) else out


def _tied_head(embedding: nn.Embedding, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head sharing the embedding's weight ``[vocab, hidden]``: logits ``[batch, seq, vocab]``."""
    return F.linear(hidden, embedding.weight)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: position ``t`` predicts ``labels[:, t + 1]``, ``-100`` ignored, the mean of
    the cross entropy (in fp32) over the counted tokens. ``logits`` ``[batch, seq, vocab]``, ``labels``
    ``[batch, seq]`` int64; returns a 0-dim fp32 tensor."""
    labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                           ignore_index=IGNORE_INDEX)  # fmt: skip


def decoder_layers(model: nn.Module) -> list:
    """The layer list of ``model`` (a transformers ``*ForCausalLM``) for ``PipelineModule(layers=...,
    loss_fn=causal_lm_loss)``: embedding, each decoder layer (:class:`DecoderLayerStage`), norm, head. The
    returned modules are ``model``'s own (its parameters, not copies), except a tied embedding and head, built
    from ``model``'s embedding weight on each stage holding them.

    Raises:
        TypeError: ``model`` lacks one of the parts named in the module notes.
    """
    try:
        embed, layers, norm = model.model.embed_tokens, model.model.layers, model.model.norm
        rotary, config, head = model.model.rotary_emb, model.config, model.lm_head
    except AttributeError as e:
        raise TypeError(f"decoder_layers: {type(model).__name__} is not a decoder-only causal LM with "
                        "model.embed_tokens, model.layers, model.norm, model.rotary_emb and lm_head (Llama, Qwen2, "
                        f"Qwen3, Mistral): {e}") from None  # fmt: skip
    eager = config._attn_implementation == "eager"
    body = [DecoderLayerStage(layer, copy.deepcopy(rotary), eager) for layer in layers]
    if config.tie_word_embeddings:
        weight = embed.weight
        shape = {"num_embeddings": weight.shape[0], "embedding_dim": weight.shape[1], "_weight": weight,
                 "padding_idx": embed.padding_idx}  # fmt: skip
        first = TiedLayerSpec("embed", nn.Embedding, **shape)
        last = TiedLayerSpec("embed", nn.Embedding, forward_fn=_tied_head, **shape)
        return [first, *body, norm, last]
    return [embed, *body, norm, head]
