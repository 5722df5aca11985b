"""Tiny transformers Mixtral and Qwen3-MoE models built from a config, their data, and the one-process reference
training the AutoEP tests compare against."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

E, TOKENS, BATCH, STEPS, VOCAB = 4, 6, 2, 3, 32  # experts, sequence length, sequences per rank, steps, vocabulary
LR = 0.5


def build(kind: str, experts: int = E, top_k: int = 2) -> torch.nn.Module:
    """A 2-layer model of ``kind`` ("mixtral" or "qwen3_moe"), ``experts`` experts, ``top_k`` routes per token, the
    same weights every call."""
    torch.manual_seed(5)
    common = dict(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=32, num_experts_per_tok=top_k, initializer_range=0.3,
                  tie_word_embeddings=False,
                  experts_implementation="eager", attn_implementation="eager")  # fmt: skip
    if kind == "mixtral":
        config = MixtralConfig(intermediate_size=6, num_local_experts=experts, **common)
        return MixtralForCausalLM(config).float()
    config = Qwen3MoeConfig(intermediate_size=6, moe_intermediate_size=6, num_experts=experts, head_dim=4,
                            norm_topk_prob=True, **common)  # fmt: skip
    return Qwen3MoeForCausalLM(config).float()


def data(step: int, rank: int) -> torch.Tensor:
    """Token ids [BATCH, TOKENS] of ``rank`` at ``step`` (the labels are the ids themselves)."""
    g = torch.Generator().manual_seed(97 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)


def config(stage: int, ep: int, **autoep) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "expert_parallel": {"enabled": True, "autoep_size": ep, **autoep}}  # fmt: skip


def tensor_parallel(kind: str, tp: int) -> dict:
    """The ``tensor_parallel`` section splitting ``kind``'s attention over ``tp`` ranks: Mixtral's preset; for
    Qwen3-MoE its own layer specs (q/k/v column, o row, the per-head q/k norms whole with their gradients summed)."""
    if kind == "mixtral":
        return {"autotp_size": tp, "preset_model": "mixtral"}
    specs = [
        {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.self_attn\.[qk]_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
    ]
    return {"autotp_size": tp, "partition_config": {"layer_specs": specs}}  # fmt: skip


def reference(kind: str, world: int, steps: int = STEPS, top_k: int = 2) -> list:
    """Per step: each rank's loss and the parameters after the step, training the unconverted model on every
    rank's batch in one process (the mean of the ranks' losses, clipped at 1.0, SGD with momentum: Adam's
    normalisation would turn rounding noise in a near-zero gradient into a whole step)."""
    model = build(kind, top_k=top_k)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)
    out = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = [model(input_ids=data(step, r), labels=data(step, r)).loss for r in range(world)]
        (sum(losses) / world).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.nn.utils.get_total_norm(grads))
        opt.step()
        out.append(([loss.item() for loss in losses], {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def local_rows(name: str, value: torch.Tensor, ep: int, ep_rank: int) -> torch.Tensor:
    """The rows of a dense expert tensor that expert-parallel rank ``ep_rank`` holds (other tensors whole)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        local = value.shape[0] // ep
        return value[ep_rank * local : (ep_rank + 1) * local]
    return value
