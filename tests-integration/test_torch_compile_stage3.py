"""``torch_compile: {enabled: true}`` (plain ``torch.compile`` of the module over the eager engine) at ZeRO stage 3
trains a transformers ``LlamaForCausalLM`` exactly as the eager engine, on 2 gloo ranks.

The bug this guards: stage 3's first-forward released-read check is a torch function mode; entered by an eager hook
while Dynamo traced the Llama forward, it made Dynamo read ``inputs_embeds.device`` as a ``torch.Size``
(``arange() received ... device=torch.Size``), and Dynamo traced into the gather/release hooks. Now the hooks are
``torch.compiler.disable``d and the engine runs the checked first forward eagerly (``EagerWhileChecking``).

The persistence threshold keeps the embedding (16 x 32 = 512 elements) and the norms gathered for good and shards
every projection (>= 1024 elements), as the 20m bench Llama whose ``torch_compile`` row failed. SGD: its update is
the gradient times the lr, so the 1e-6 relative bound checks the gradients themselves (Adam's normalisation would
magnify last-bit differences of near-zero gradients, which aot_eager's decomposed ops may sum in another order).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks

STEPS = 3


def _train(compiled: bool):
    """Losses, final full parameters, stage 3 gathers and Dynamo graphs compiled, for one run on this rank."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         attn_implementation="sdpa"))  # fmt: skip
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 600},
           "torch_compile": {"enabled": compiled, "backend": "aot_eager"}}  # fmt: skip
    engine, *_ = zero.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 16, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = {k: v.clone() for k, v in engine.runtime.full_parameters().items()}
    gathers = engine.runtime.params.gathers
    engine.destroy()
    return losses, params, gathers, counters["stats"]["unique_graphs"]


def _both():
    return _train(False), _train(True)


def test_stage3_torch_compile_llama_equals_eager_engine():
    for rank, (eager, comp) in enumerate(run_ranks(_both, 2, timeout=600)):
        (l_e, p_e, g_e, graphs_e), (l_c, p_c, g_c, graphs_c) = eager, comp
        assert graphs_e == 0 and graphs_c > 0, (graphs_e, graphs_c)  # the compiled run did compile
        torch.testing.assert_close(torch.tensor(l_c), torch.tensor(l_e), rtol=1e-6, atol=0, msg=f"losses rank {rank}")
        assert p_c.keys() == p_e.keys()
        for k in p_e:
            torch.testing.assert_close(p_c[k], p_e[k], rtol=1e-6, atol=1e-7, msg=f"{k} rank {rank}")
        # the compiled forwards still gather every sharded unit through the eager hooks, as often as eager does
        assert g_c == g_e > 0, (g_c, g_e)
