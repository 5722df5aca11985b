"""zero's own decode loop (``InferenceEngine.generate`` on fused Llama blocks), in one process on the CPU.

For an unpadded prompt and transformers' greedy or sampling keywords the engine decodes itself (prefill, then one
token at a time over its static KV cache) and gives the tokens transformers' ``generate`` gives the same model:
greedy, sampled with temperature, top-k and top-p from the same seed, and a row that reaches ``eos_token_id``
padded after it. A call the loop does not cover (a padded prompt) still goes to transformers.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zero_inference import init_inference

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def _both(kwargs: dict, seed: int = 0):
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    reference, engine = _llama(), init_inference(_llama(), replace_with_kernel_inject=True, dtype=torch.float32)
    runs = []
    for generate in (reference.generate, engine.generate):
        torch.manual_seed(seed)
        with torch.no_grad():
            runs.append(generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs))
    return runs, engine, ids


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "eos_token_id": None},
        {"max_new_tokens": 12, "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "pad_token_id": 0},
        {"max_new_tokens": 12, "do_sample": True, "pad_token_id": 0, "eos_token_id": None},
    ],
    ids=["greedy", "sampled-temperature-top-k-top-p", "sampled-defaults"],
)
def test_the_engines_own_loop_gives_the_tokens_of_transformers_generate(kwargs):
    (reference, tokens), engine, ids = _both(kwargs, seed=5)
    assert engine._decode_loop.cache is not None  # decoded by the engine's loop, not transformers'
    assert tokens.shape == (2, ids.shape[1] + 12) and tokens.dtype == torch.int64
    assert torch.equal(tokens, reference)


def test_a_row_that_reaches_eos_is_padded_until_every_row_stops():
    greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    (free, _), _, ids = _both(greedy)
    eos = int(free[0, ids.shape[1] + 2])  # the first row's third new token ends it
    (reference, tokens), _, _ = _both({**greedy, "eos_token_id": eos, "pad_token_id": 1})
    assert torch.equal(tokens, reference)
    assert (tokens[0, ids.shape[1] + 3 :] == 1).any()


def test_a_padded_prompt_goes_to_transformers_generate():
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    engine = init_inference(_llama(), replace_with_kernel_inject=True, dtype=torch.float32)
    with torch.no_grad():
        reference = _llama().generate(input_ids=ids, **kwargs)
        out = engine.generate(input_ids=ids, return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, reference) and type(out.past_key_values).__name__ == "StaticCache"
