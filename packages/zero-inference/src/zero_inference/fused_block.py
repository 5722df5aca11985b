"""``replace_with_kernel_inject=True``: each Llama decoder layer replaced by one fused decoding block.

DeepSpeed 0.19.8 swaps transformer layers for its CUDA inference kernels (``DeepSpeedTransformerInference``); zero
swaps each transformers ``LlamaDecoderLayer`` for a :class:`FusedDecoderBlock` of plain torch ops that runs on CPU
and GPU alike and computes what the layer computes:

* one fused QKV projection (the q, k, v weights concatenated: one matmul instead of three), rotary embedding, the
  key/value states written into the model's KV cache (``InferenceEngine.generate`` asks transformers for its static
  cache, preallocated once per call, unless the caller passes another), ``scaled_dot_product_attention`` with the
  mask transformers built (causal when none) over the cache's written positions (up to the last
  ``cache_position``; the whole cache, under the mask, when compiled), one output projection;
* one fused gate/up projection, the activation, the down projection;
* with tensor parallelism the block is built from the rank's shards (whole heads, a slice of the MLP) and sums the
  two row-parallel outputs over the group (one all-reduce after each, bias added once after the sum), as the split
  layers did.

Each projection's weight is stored in the layout the device reads faster for one token
(:mod:`zero_inference.projection`: ``nn.Linear``'s ``[out, in]`` or ``[in, out]``, chosen per shape). The weights
are the layer's own tensors (or their transposed copies), concatenated once at injection (the originals are dropped;
the engine's ``layout`` still names the split parameters as they were before). Layers are fused one at a time, each
original freed (with glibc its pages returned to the system) before the next, so injection holds one layer beyond
the model.
Models whose decoder layers are not Llama's are refused, naming their class.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch
import torch.nn.functional as F

from zero_comm import all_reduce
from zero_inference.projection import project, store

FUSED_LAYERS = ("LlamaDecoderLayer",)
"""transformers decoder-layer classes (by name) that have a fused block."""


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FusedDecoderBlock(torch.nn.Module):
    """A Llama decoder layer as one fused block, called as transformers calls the layer.

    Args:
        layer: the transformers ``LlamaDecoderLayer`` (its projections plain or zero_parallel's split layers).
        head_dim: the attention head size; group: the tensor-parallel group (None: no all-reduce).

    Forward: ``hidden_states`` ``[batch, seq, hidden]`` -> ``[batch, seq, hidden]`` (same dtype); keyword
    arguments as transformers' decoder layers take them (``position_embeddings`` (cos, sin) required,
    ``attention_mask``, ``cache`` / ``past_key_values``, ``cache_position``).
    """

    def __init__(self, layer: torch.nn.Module, head_dim: int, group=None):
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attn.layer_idx
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.group = group
        self.q_width, self.kv_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        self.kv_groups = self.q_width // self.kv_width
        with torch.no_grad():
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            self.qkv_weight, self.qkv_transposed = store(qkv)
            del qkv
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            self.qkv_bias = None if biases[0] is None else torch.nn.Parameter(torch.cat(biases), requires_grad=False)
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self.gate_up_weight, self.gate_up_transposed = store(gate_up)
            del gate_up
        self.o_weight, self.o_transposed = store(attn.o_proj.weight)
        self.o_bias = attn.o_proj.bias
        self.down_weight, self.down_transposed = store(mlp.down_proj.weight)
        self.down_bias = mlp.down_proj.bias
        self.act_fn = mlp.act_fn
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm

    def _row(self, x: torch.Tensor, weight: torch.Tensor, transposed: bool, bias: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel projection: the local product summed over the group, then the bias."""
        y = project(x, weight, transposed)
        if self.group is not None:
            y = y.contiguous()
            all_reduce(y, self.group, op="sum")
        return y + bias if bias is not None else y

    def _attention(self, x: torch.Tensor, cos, sin, mask, cache, cache_position) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = project(x, self.qkv_weight, self.qkv_transposed, self.qkv_bias)
        q, k, v = qkv.split([self.q_width, self.kv_width, self.kv_width], dim=-1)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, {"sin": sin, "cos": cos, "cache_position": cache_position})
            if cache_position is not None and not torch.compiler.is_compiling():
                filled = int(cache_position[-1]) + 1  # a static cache: attend over the written positions only
                k, v = k[:, :, :filled], v[:, :, :filled]
        if self.kv_groups > 1:
            k, v = k.repeat_interleave(self.kv_groups, dim=1), v.repeat_interleave(self.kv_groups, dim=1)
        if mask is not None and mask.dim() == 4:
            mask = mask[:, :, :, : k.shape[-2]]
        causal = mask is None and s > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scaling)
        return self._row(out.transpose(1, 2).reshape(b, s, -1), self.o_weight, self.o_transposed, self.o_bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                use_cache=None, position_embeddings=None, past_key_values=None, cache_position=None,
                **kwargs) -> torch.Tensor:  # fmt: skip
        """One decoder layer: attention and MLP, each with its residual (see the class docstring)."""
        cos, sin = position_embeddings
        kv_cache = cache if cache is not None else past_key_values
        h = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self._attention(h, cos, sin, attention_mask, kv_cache, cache_position)
        h = self.post_attention_layernorm(hidden_states)
        gate, up = project(h, self.gate_up_weight, self.gate_up_transposed).chunk(2, dim=-1)
        return hidden_states + self._row(self.act_fn(gate) * up, self.down_weight, self.down_transposed, self.down_bias)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # no C library found, or not glibc
        return None


def has_fused_blocks(model: torch.nn.Module) -> bool:
    """Whether some decoder layer of ``model`` has a fused block (its class is in :data:`FUSED_LAYERS`)."""
    return any(type(m).__name__ in FUSED_LAYERS for m in model.modules())


def inject_fused_blocks(model: torch.nn.Module, group=None) -> int:
    """Replace every decoder layer of ``model`` whose class is in :data:`FUSED_LAYERS` by a
    :class:`FusedDecoderBlock`, in place; returns how many were replaced.

    Raises:
        ValueError: no such layer: the message names the classes of the model's layer stack (the first
            ``nn.ModuleList``) and what to do instead.
    """
    cfg = getattr(model, "config", None)  # transformers models carry one; head_dim lives there
    cfg = getattr(cfg, "text_config", None) or cfg
    head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads if cfg else None)
    # Names, not modules, are listed first: each replaced layer is then freed before the next is fused, and its
    # pages given back (the fused weights are larger than the freed pieces, which the heap would otherwise keep), so
    # the concatenated weights cost one layer at a time beyond the model.
    where = [(parent, name) for parent, m in model.named_modules() for name, child in m.named_children()
             if type(child).__name__ in FUSED_LAYERS]  # fmt: skip
    for parent, name in where:
        owner = model.get_submodule(parent)
        setattr(owner, name, FusedDecoderBlock(getattr(owner, name), head_dim, group))
        trim = _malloc_trim()
        if trim is not None:
            trim(0)
    replaced = len(where)
    if not replaced:
        stack = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)), None)
        found = sorted({type(m).__name__ for m in stack}) if stack is not None else [type(model).__name__]
        raise ValueError(f"replace_with_kernel_inject: zero has fused blocks for {list(FUSED_LAYERS)} only, and this "
                         f"model's layers are {found}; leave replace_with_kernel_inject False (tensor_parallel.tp_size "
                         "still splits the model with AutoTP, and injection_policy={LayerClass: ('o_proj-like', "
                         "'down_proj-like names')} names its row-parallel layers)")  # fmt: skip
    return replaced
