"""DeepSpeed 0.19.8's inference config keys as ``init_inference`` reads them, in one process (tp_size 1).

The values and refusals asserted are what DeepSpeed's ``DeepSpeedInferenceConfig`` gives for the same input
(aliases, the deprecated ``mp_size``, ``"auto"`` dropped, extra keys forbidden), plus zero's refusals of what it
does not implement, each naming the key.
"""

import json

import pytest
import torch
from torch import nn

from zero_inference import DeepSpeedInferenceConfig, InferenceConfigError, init_inference, supported_dtypes


def test_aliases_deprecated_keys_and_defaults():
    cfg = DeepSpeedInferenceConfig(mp_size=2)
    assert (cfg.tensor_parallel.tp_size, cfg.dtype, cfg.max_out_tokens) == (2, torch.float16, 1024)
    cfg = DeepSpeedInferenceConfig(tp={"tp_size": 2, "tp_grain_size": 32}, max_tokens=8, kernel_inject=False,
                                   dtype="bf16", tm=False, keep_module_on_host=True)  # fmt: skip
    assert (cfg.tensor_parallel.tp_size, cfg.tensor_parallel.tp_grain_size, cfg.max_out_tokens) == (2, 32, 8)
    assert (cfg.dtype, cfg.triangular_masking, cfg.keep_module_on_host) == (torch.bfloat16, False, True)
    cfg = DeepSpeedInferenceConfig(dtype="auto", max_out_tokens="auto", replace_method="auto", moe=False, ep_size=1)
    assert (cfg.dtype, cfg.max_out_tokens, cfg.replace_method) == (torch.float16, 1024, "auto")
    for spelling, dtype in (("half", torch.float16), ("float", torch.float32), ("torch.bfloat16", torch.bfloat16),
                            (torch.float32, torch.float32)):  # fmt: skip
        assert DeepSpeedInferenceConfig(dtype=spelling).dtype == dtype


@pytest.mark.parametrize(
    "keys, error, words",
    [
        ({"tp": {"tp_size": 2}, "mp_size": 2}, InferenceConfigError, "deprecated mp_size and its replacement"),
        ({"max_tokens": 0}, InferenceConfigError, "max_out_tokens = 0: expected an int > 0"),
        ({"foo": 1}, InferenceConfigError, "unknown inference config key(s) ['foo']"),
        ({"tensor_parallel": {"tp_size": 2, "x": 1}}, InferenceConfigError, "['x'] in tensor_parallel"),
        ({"tensor_parallel": {"tp_size": 0}}, InferenceConfigError, "tensor_parallel.tp_size = 0"),
        ({"tp": {}, "tensor_parallel": {}}, InferenceConfigError, "given twice"),
        ({"dtype": 3}, TypeError, "expected a torch.dtype"),
        ({"dtype": "fp64"}, InferenceConfigError, "dtype 'fp64' is not a dtype"),
        ({"replace_with_kernel_inject": 1}, InferenceConfigError, "replace_with_kernel_inject = 1: expected a bool"),
        ({"checkpoint": 3}, InferenceConfigError, "checkpoint = 3: expected a folder or JSON path"),
        ({"enable_cuda_graph": True}, InferenceConfigError, "enable_cuda_graph = True"),
        ({"moe": {"ep_size": 2}}, InferenceConfigError, "moe.ep_size = 2 is not supported"),
        ({"quant": {"enabled": True}}, InferenceConfigError, "quant = "),
        ({"return_tuple": "yes"}, InferenceConfigError, "return_tuple = 'yes': expected a bool"),
    ],
)
def test_bad_keys_are_refused_naming_the_key(keys, error, words):
    with pytest.raises(error) as e:
        DeepSpeedInferenceConfig(**keys)
    assert words in str(e.value)


def test_init_inference_merges_config_and_keywords(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    want = net(x)
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "fp32", "max_tokens": 4}))
    engine = init_inference(net, str(path), dtype="fp32")  # the same value in both: accepted
    assert engine.module is net and torch.equal(engine(x), want) and engine.mp_group is None
    assert engine._config.max_out_tokens == 4
    with pytest.raises(ValueError, match="conflicting argument 'dtype'"):
        init_inference(net, {"dtype": "fp32"}, dtype="bf16")
    with pytest.raises(ValueError, match="config must be a dict or a JSON file path"):
        init_inference(net, 3)
    with pytest.raises(AttributeError, match="has no generate"):
        engine.generate(x)
    bf16 = init_inference(nn.Linear(4, 2), dtype=torch.bfloat16)
    assert bf16.module.weight.dtype == torch.bfloat16 and torch.bfloat16 in supported_dtypes(torch.device("cpu"))


def test_generate_checks_beams_and_prompt_length_as_deepspeed():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))  # fmt: skip
    engine = init_inference(model, dtype="fp32", max_out_tokens=4)
    with pytest.raises(NotImplementedError, match="num_beams=2"):
        engine.generate(input_ids=torch.zeros(1, 3, dtype=torch.long), num_beams=2)
    with pytest.raises(RuntimeError, match="input of 5 tokens exceeds max_out_tokens 4"):
        engine.generate(input_ids=torch.zeros(1, 5, dtype=torch.long), max_new_tokens=1)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert torch.equal(engine.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0), want)


def test_kernel_inject_refuses_models_without_a_fused_block():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))  # fmt: skip
    with pytest.raises(ValueError, match=r"this model's layers are \['Qwen3DecoderLayer'\]; leave replace_with_kernel"):
        init_inference(model, dtype="fp32", replace_with_kernel_inject=True)
    with pytest.raises(ValueError, match="injection_policy and replace_with_kernel_inject together"):
        init_inference(model, dtype="fp32", kernel_inject=True, injection_policy={nn.Linear: "o_proj"})
