"""``InferenceEngine.compile()`` (DeepSpeed's ``engine.compile``) on the fused Llama blocks, in one process on the CPU.

With inductor the one-token decode step over the static KV cache is compiled once: greedy ``generate`` gives the
tokens of the uncompiled transformers model, and a second ``generate`` of the same shape compiles nothing more.
The compiled ``forward`` gives the model's logits; ``compile`` twice is one compile; inductor on a CPU without a C++
compiler is refused naming the cause.
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from zero_inference import CompileError, init_inference

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0)  # fmt: skip


def test_the_decode_step_is_compiled_once_and_gives_the_models_tokens():
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    reference = _greedy(_llama(), ids)
    engine = init_inference(_llama(), replace_with_kernel_inject=True, dtype=torch.float32)
    engine.compile()
    before = counters["stats"]["unique_graphs"]
    first = _greedy(engine, ids)
    compiled = counters["stats"]["unique_graphs"] - before
    second = _greedy(engine, ids)
    assert engine.is_compiled
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert compiled == 1  # the decode step, in one graph (the prefill runs eagerly)
    assert counters["stats"]["unique_graphs"] - before == 1  # the second generate reused it


def test_compiled_forward_gives_the_models_logits():
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = _llama()(input_ids=ids).logits
    engine = init_inference(_llama(), replace_with_kernel_inject=True, dtype=torch.float32)
    engine.compile(backend="aot_eager")
    engine.compile(backend="aot_eager")  # a second call does nothing, as DeepSpeed's
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


def test_inductor_on_a_cpu_without_a_cpp_compiler_is_refused(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    engine = init_inference(_llama(), dtype=torch.float32)
    with pytest.raises(CompileError, match="C\\+\\+ compiler"):
        engine.compile()
    assert not engine.is_compiled
