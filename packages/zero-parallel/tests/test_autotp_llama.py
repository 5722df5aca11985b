"""AutoTP at tp=2 (2 gloo ranks) on transformers' tiny Llama against the same model in one process (fp32):

* logits equal the single-process logits (1e-6) on every rank;
* each rank's gradient of a split parameter equals its slice of the full gradient, and every replicated
  parameter's gradient equals the full one (so it is the same on both ranks);
* two models: GQA (4 heads, 2 key-value heads) split by the model's transformers plan with an untied LM head
  (column-split, output gathered) and an intermediate size of 37 (uneven MLP shards 19 / 18); and 6 heads over 3
  key-value heads (uneven head shards 2 / 1) by the "llama" preset with tied embeddings (LM head replicated).
"""

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from zero_comm.testing import run_ranks
from zero_parallel import (
    PartitionConfig,
    RowParallelLinear,
    apply_autotp,
    init_parallel_mesh,
    layout_of,
    resolve_specs,
)

TP = 2


def tiny_llama(heads: int, kv_heads: int, intermediate: int, tied: bool) -> LlamaForCausalLM:
    """transformers' Llama with 2 layers, head_dim 8, vocab 64; the same weights on every rank."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
                         tie_word_embeddings=tied, attn_implementation="eager")  # fmt: skip
    return LlamaForCausalLM(config).float()


def _compare(heads: int, kv_heads: int, intermediate: int, tied: bool, preset: str | None) -> dict:
    reference = tiny_llama(heads, kv_heads, intermediate, tied)
    model = tiny_llama(heads, kv_heads, intermediate, tied)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    ref_out = reference(input_ids=ids, labels=ids)
    ref_out.loss.backward()
    full_grads = {n: p.grad for n, p in reference.named_parameters()}
    mesh = init_parallel_mesh(tensor_parallel_size=TP)
    layout = apply_autotp(model, mesh.get_group("tp"), resolve_specs(model, None, preset))
    assert layout_of(model) is layout and layout.size == TP
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    logit_err = (out.logits - ref_out.logits).abs().max().item()
    grad_err, replicated = 0.0, []
    for name, p in model.named_parameters():
        shard = layout.shards.get(name)
        want = shard.shard(full_grads[name], layout.rank) if shard is not None else full_grads[name]
        assert p.grad.shape == want.shape, name
        grad_err = max(grad_err, (p.grad - want).abs().max().item())
        if shard is None:
            replicated.append(name)
    attn = model.model.layers[0].self_attn
    return {"logit_err": logit_err, "grad_err": grad_err, "split": sorted(layout.shards), "replicated": replicated,
            "q_rows": attn.q_proj.weight.shape[0], "kv_rows": attn.k_proj.weight.shape[0],
            "mlp": model.model.layers[0].mlp.up_proj.weight.shape[0],
            "row": isinstance(attn.o_proj, RowParallelLinear), "lm_head": tuple(model.lm_head.weight.shape),
            "source": layout.source, "group": dist.get_process_group_ranks(mesh.get_group("tp"))}  # fmt: skip


def _both_models() -> list[dict]:
    return [_compare(4, 2, 37, False, None), _compare(6, 3, 32, True, "llama")]


def test_tp2_logits_and_gradient_shards_equal_one_process():
    gqa, uneven = zip(*run_ranks(_both_models, TP, timeout=120))
    for r, res in enumerate(gqa):
        assert res["logit_err"] <= 1e-6 and res["grad_err"] <= 1e-6, res
        assert res["source"] == "the model's transformers tp_plan" and res["group"] == [0, 1]
        assert (res["q_rows"], res["kv_rows"], res["row"]) == (16, 8, True)  # 2 of 4 heads, 1 of 2 kv heads
        assert res["mlp"] == (19, 18)[r]
        assert res["lm_head"] == (32, 32)  # untied: its 64 vocab rows split by the plan's colwise_gather_output
        assert "model.layers.1.mlp.down_proj.weight" in res["split"] and "lm_head.weight" in res["split"]
        assert set(res["replicated"]) >= {"model.embed_tokens.weight", "model.norm.weight"}
    for r, res in enumerate(uneven):
        assert res["logit_err"] <= 1e-6 and res["grad_err"] <= 1e-6, res
        assert res["source"] == "preset 'llama'"
        assert (res["q_rows"], res["kv_rows"]) == ((32, 16)[r], (16, 8)[r])  # heads 4/2, kv heads 2/1
        assert res["lm_head"] == (64, 48)  # tied to the embedding: replicated
        assert "lm_head.weight" not in res["split"]


def _refusals() -> list[str]:
    mesh = init_parallel_mesh(tensor_parallel_size=TP)
    messages = []
    model = tiny_llama(4, 1, 32, False)  # one key-value head cannot be split over 2 ranks
    with pytest.raises(ValueError) as e:
        apply_autotp(model, mesh.get_group("tp"), resolve_specs(model, None, "llama"))
    messages.append(str(e.value))
    assert layout_of(model) is None and isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    strict = PartitionConfig(resolve_specs(model, None, "llama").layer_specs, strict_mode=True)
    model = tiny_llama(4, 2, 32, False)
    model.model.layers[0].extra = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as e:
        apply_autotp(model, mesh.get_group("tp"), strict)
    messages.append(str(e.value))
    return messages


def test_refusals_name_the_layer_and_leave_the_model_whole():
    for kv, strict in run_ranks(_refusals, TP, timeout=60):
        assert "rank(s) [1] would hold none of 'model.layers.0.self_attn.q_proj.weight'" in kv
        assert "1 key-value heads" in kv
        assert "strict_mode: Linear 'model.layers.0.extra' matches no layer_specs pattern" in strict
