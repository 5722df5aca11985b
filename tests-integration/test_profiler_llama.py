"""zero_profiler on real workloads: a tiny Llama's FLOPs per token vs 6N, and profiling across gloo collectives.

Convention for the 6N rule of thumb (Kaplan et al. 2020, section 2.1): forward + backward FLOPs per token is about
6 x N, with N the non-embedding parameters. Here N = every parameter not owned by an ``nn.Embedding``: the decoder
layers, the final norm and the (untied) ``lm_head``, whose matmul does real work for every token. The profiler
adds what 6N leaves out (attention scores, norms, activations, the loss), so the ratio sits a little above 1.
"""

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from zero_comm import all_gather_into_tensor
from zero_comm.testing import run_ranks
from zero_profiler import FlopsProfiler


def _tiny_llama() -> tuple[LlamaForCausalLM, LlamaConfig]:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    return LlamaForCausalLM(config), config


def test_llama_forward_backward_flops_per_token_within_20_percent_of_6n():
    model, cfg = _tiny_llama()
    batch, seq = 2, 64
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    with FlopsProfiler(model) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    p = prof.profile
    tokens = batch * seq

    # Exact forward MACs: every token through every Linear weight, plus QK^T and PV per layer and head.
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = cfg.num_hidden_layers * batch * cfg.num_attention_heads * seq * seq * 2 * head_dim
    assert p.forward.macs == tokens * linear_weights + attention
    # Backward: each matmul's two gradient matmuls; the first layer's input gradient too (embeddings train).
    assert p.backward.macs == 2 * p.forward.macs

    embedding = model.model.embed_tokens.weight.numel()
    n = sum(q.numel() for q in model.parameters()) - embedding
    assert p.non_embedding_params == n == 467_584
    ratio = p.flops_per_token(tokens) / (6 * n)
    assert 0.8 <= ratio <= 1.2, f"fwd+bwd FLOPs per token = {ratio:.3f} x 6N"
    assert f"{ratio:.3f} x (6 x non-embedding params)" in p.format(tokens=tokens, module_depth=1)


def _gathered_linear_body(world_size: int) -> dict:
    """Each rank holds half of a Linear's flat weight and all-gathers it in forward, as ZeRO-3 does."""
    rank = dist.get_rank()
    torch.manual_seed(1234)
    full = nn.Linear(19, 13, bias=False)  # 247 elements: uneven, padded to 124 per rank
    flat = full.weight.detach().reshape(-1)
    per = -(-flat.numel() // world_size)
    padded = torch.cat([flat, flat.new_zeros(per * world_size - flat.numel())])

    class Sharded(nn.Module):
        def __init__(self):
            super().__init__()
            self.shard = nn.Parameter(padded[rank * per : (rank + 1) * per].clone())

        def forward(self, x):
            out = torch.empty(per * world_size)
            all_gather_into_tensor(out, self.shard.detach().contiguous(), dist.group.WORLD).wait(timeout=30)
            return x @ out[: flat.numel()].view(13, 19).t()

    model = nn.Sequential(Sharded(), nn.GELU())
    x = torch.randn(3, 19)
    full_numel = {id(model[0].shard): flat.numel()}
    with FlopsProfiler(model, param_count_fn=lambda q: full_numel[id(q)]) as prof:
        y = model(x)
    with FlopsProfiler(nn.Sequential(full, nn.GELU())) as ref:
        y_ref = ref.model(x)
    torch.testing.assert_close(y, y_ref)
    p, r = prof.profile, ref.profile
    return {
        "params": (p.total_params, r.total_params),
        "macs": (p.forward.macs, r.forward.macs),
        "matmul_flops": (p.forward.by_category["matmul"], r.forward.by_category["matmul"]),
        "dispatch_stack": torch._C._len_torch_dispatch_stack(),
    }


def test_profiling_across_gloo_all_gather_matches_the_unsharded_reference():
    results = run_ranks(_gathered_linear_body, 2, 2, timeout=60)
    for rank, res in enumerate(results):
        assert res["params"] == (247, 247), rank
        assert res["macs"] == (3 * 13 * 19, 3 * 13 * 19), rank
        assert res["matmul_flops"][0] == res["matmul_flops"][1], rank
        assert res["dispatch_stack"] == 0, rank
