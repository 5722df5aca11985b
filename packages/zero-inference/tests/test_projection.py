"""The fused blocks' weight layout: each projection stored as ``nn.Linear``'s ``[out, in]`` or as ``[in, out]``,
whichever the CPU's matrix library streams faster for one token. Either layout must compute what ``F.linear`` does,
and a model decodes the same tokens as transformers' ``generate`` whichever layout each projection gets."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from zero_inference import init_inference, projection

CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_stored_projection_computes_f_linear(monkeypatch, transposed, dtype):
    monkeypatch.setattr(projection, "transposed_is_faster", lambda weight: transposed)
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(48, dtype=dtype)
    x = torch.randn(3, 1, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    stored, was_transposed = projection.store(weight)
    assert was_transposed is transposed and not stored.requires_grad
    assert stored.shape == ((32, 48) if transposed else (48, 32)) and stored.is_contiguous()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(projection.project(x, stored, transposed, bias), F.linear(x, weight, bias),
                               rtol=tol, atol=tol)  # fmt: skip


def test_the_layout_choice_is_timed_once_per_shape_and_dtype():
    weight = torch.randn(40, 24)
    first = projection.transposed_is_faster(weight)
    assert isinstance(first, bool)
    assert projection.transposed_is_faster(torch.zeros(40, 24)) is first  # cached: the same answer, no new timing
    assert (tuple(weight.shape), weight.dtype, "cpu") in projection._CHOSEN


@pytest.mark.parametrize("transposed", [False, True], ids=["out-in", "in-out"])
def test_fused_blocks_in_either_layout_decode_transformers_tokens(monkeypatch, transposed):
    monkeypatch.setattr(projection, "transposed_is_faster", lambda weight: transposed)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    torch.manual_seed(0)
    engine = init_inference(LlamaForCausalLM(LlamaConfig(**CONFIG)).eval(), replace_with_kernel_inject=True,
                            dtype=torch.float32)  # fmt: skip
    block = engine.module.model.layers[0]
    assert (block.qkv_transposed, block.gate_up_transposed, block.o_transposed, block.down_transposed) == (
        transposed,) * 4  # fmt: skip
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 12, "do_sample": False, "pad_token_id": 0,
              "eos_token_id": None}  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(engine.generate(input_ids=ids, **kwargs), reference.generate(input_ids=ids, **kwargs))
