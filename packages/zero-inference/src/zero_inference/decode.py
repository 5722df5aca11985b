"""zero's own decode loop for a ``LlamaForCausalLM`` with fused blocks: what ``InferenceEngine.generate`` runs in
place of transformers' ``generate`` when the call asks for nothing more than it does.

It computes what transformers' ``generate`` computes for greedy decoding and for sampling (``do_sample`` with
``temperature``, ``top_k``, ``top_p``, applied in transformers' order, then one ``torch.multinomial`` draw per row),
stopping a row at ``eos_token_id`` (later tokens ``pad_token_id``) and the call when every row has stopped or
``max_new_tokens`` were generated: the prompt runs once through the model (the prefill, causal), then each new
token runs alone (the decode step) over a static KV cache of ``prompt + max_new_tokens`` positions. Uncompiled, the
blocks attend over the filled part of the cache only; with ``compile_step`` the decode step is compiled once per
batch size and cache length (its shapes do not change from token to token: the cache is attended in full under a
mask of the filled positions) and reused by later calls.

:func:`own_loop_applies` says when it runs: a ``LlamaForCausalLM``, ``input_ids`` (keyword or the one positional
argument) with no padding, ``max_new_tokens`` given, and only the keywords of :data:`LOOP_KEYWORDS`; the model's
``generation_config`` differing from transformers' defaults in those fields and token ids only. Anything else
(padding, beams excluded already, ``return_dict_in_generate``, logits processors, ...) goes to transformers.
"""

from __future__ import annotations

import torch

LOOP_KEYWORDS = frozenset({"input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k",
                           "top_p", "pad_token_id", "eos_token_id", "use_cache"})  # fmt: skip
"""``generate`` keywords the loop honours."""

_CONFIG_FIELDS = frozenset({"do_sample", "temperature", "top_k", "top_p", "pad_token_id", "eos_token_id",
                            "bos_token_id", "use_cache", "output_attentions", "output_hidden_states",
                            "_from_model_config", "transformers_version"})  # fmt: skip
_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' generate defaults


def own_loop_applies(model: torch.nn.Module, inputs: tuple, kwargs: dict) -> bool:
    """Whether :class:`DecodeLoop` computes this ``generate`` call (see the module docstring)."""
    if type(model).__name__ != "LlamaForCausalLM" or len(inputs) > 1 or "max_new_tokens" not in kwargs:
        return False
    if not kwargs.keys() <= LOOP_KEYWORDS or kwargs.get("use_cache", True) is not True:
        return False
    ids = kwargs.get("input_ids", inputs[0] if inputs else None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or (inputs and "input_ids" in kwargs):
        return False
    mask = kwargs.get("attention_mask")
    if mask is not None and (mask.shape != ids.shape or not bool(mask.all())):
        return False
    config = model.generation_config
    return config is not None and config.to_diff_dict().keys() <= _CONFIG_FIELDS


class StaticKV:
    """A preallocated key/value cache, ``[batch, kv heads of this rank, length, head_dim]`` per layer, written at
    the cache positions given (what the fused blocks call ``update`` on, as on transformers' ``StaticCache``)."""

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int, like: torch.Tensor):
        shape = (batch, kv_heads, length, head_dim)
        self.keys = [like.new_zeros(shape) for _ in range(layers)]
        self.values = [like.new_zeros(shape) for _ in range(layers)]
        self.shape = shape

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, cache_kwargs: dict):
        """Write ``k``, ``v`` ``[batch, heads, s, head_dim]`` at ``cache_kwargs["cache_position"]`` (``[s]``);
        returns the layer's whole key and value cache."""
        pos = cache_kwargs["cache_position"]
        self.keys[layer_idx].index_copy_(2, pos, k)
        self.values[layer_idx].index_copy_(2, pos, v)
        return self.keys[layer_idx], self.values[layer_idx]


class DecodeLoop:
    """Greedy or sampled decoding of ``model`` (a ``LlamaForCausalLM`` whose layers are fused blocks).

    Args:
        model: the model; compile_step: None (eager) or ``torch.compile``'s arguments for the decode step.
    """

    def __init__(self, model: torch.nn.Module, compile_step: dict | None = None):
        self.model = model
        self.cache: StaticKV | None = None
        self.step = torch.compile(self._forward, **compile_step) if compile_step is not None else self._forward

    def _forward(self, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of the last of ``ids`` ``[batch, s]`` at cache positions ``position`` ``[s]``."""
        body = self.model.model
        mask = None
        if torch.compiler.is_compiling():  # the whole cache is attended: mask the positions not written yet
            length = self.cache.shape[2]
            mask = (torch.arange(length, device=ids.device) <= position[-1]).view(1, 1, 1, length)
        h = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(h, position.unsqueeze(0).expand(ids.shape[0], -1))
        for block in body.layers:
            h = block(h, attention_mask=mask, position_embeddings=(cos, sin), past_key_values=self.cache,
                      cache_position=position)  # fmt: skip
        return self.model.lm_head(body.norm(h[:, -1:]))[:, -1].float()

    def _cache_for(self, batch: int, length: int, like: torch.Tensor) -> StaticKV:
        block = self.model.model.layers[0]
        shape = (batch, block.kv_width // block.head_dim, length, block.head_dim)
        if self.cache is None or self.cache.shape != shape or self.cache.keys[0].dtype != like.dtype:
            self.cache = StaticKV(len(self.model.model.layers), *shape, like)
        return self.cache

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int, options: dict) -> torch.Tensor:
        """Tokens ``[batch, prompt + generated]`` (int64), ``options`` the call's keywords of
        :data:`LOOP_KEYWORDS` other than the ids, mask and count."""
        config = self.model.generation_config
        pick = {k: options.get(k, getattr(config, k, None)) for k in (*_DEFAULTS, "pad_token_id", "eos_token_id")}
        for k, default in _DEFAULTS.items():
            pick[k] = default if pick[k] is None else pick[k]
        eos = pick["eos_token_id"]
        eos = None if eos is None else torch.as_tensor(eos, device=ids.device).view(-1)
        pad = pick["pad_token_id"] if pick["pad_token_id"] is not None else (None if eos is None else int(eos[0]))
        batch, prompt = ids.shape
        self._cache_for(batch, prompt + max_new_tokens, self.model.lm_head.weight)
        logits = self._forward(ids, torch.arange(prompt, device=ids.device))
        out, running = [ids], torch.ones(batch, dtype=torch.bool, device=ids.device)
        for i in range(max_new_tokens):
            token = self._choose(logits, pick)
            if eos is not None:
                token = torch.where(running, token, torch.full_like(token, pad))
                running = running & ~torch.isin(token, eos)
            out.append(token[:, None])
            if i == max_new_tokens - 1 or (eos is not None and not bool(running.any())):
                break
            logits = self.step(token[:, None], torch.tensor([prompt + i], device=ids.device))
        return torch.cat(out, dim=1)

    @staticmethod
    def _choose(logits: torch.Tensor, pick: dict) -> torch.Tensor:
        """The next token per row: argmax, or sampled after temperature, top-k, top-p (transformers' order)."""
        if not pick["do_sample"]:
            return logits.argmax(dim=-1)
        if pick["temperature"] != 1.0:
            logits = logits / pick["temperature"]
        if pick["top_k"]:
            kth = torch.topk(logits, min(pick["top_k"], logits.shape[-1]))[0][..., -1, None]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if pick["top_p"] < 1.0:
            ordered, order = torch.sort(logits, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - pick["top_p"]
            drop[..., -1:] = False
            logits = logits.masked_fill(drop.scatter(1, order, drop), -float("inf"))
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)
