"""The backend zero's engines compile a model with when asked for inductor (``engine.compile()``,
``torch_compile.enabled``): on a CPU model zero_compile's ``CpuAttentionBackend`` (inductor, bf16/fp16 attention
in fp32 where that is faster); anything else, or inductor with ``mode``/``options`` (which torch.compile takes
only for its own inductor), as asked. Pipeline training through it: test_pipeline_hf.py."""

import torch

from zero.engine.compiled import torch_backend
from zero_compile.cpu_backend import CpuAttentionBackend


def test_inductor_on_a_cpu_model_gets_the_cpu_attention_backend():
    cpu = torch.nn.Linear(2, 2)
    chosen = torch_backend("inductor", cpu)
    assert isinstance(chosen, CpuAttentionBackend) and chosen.inner == "inductor"
    assert isinstance(torch_backend("inductor", torch.nn.ReLU()), CpuAttentionBackend)  # no parameters: CPU
    assert torch_backend("aot_eager", cpu) == "aot_eager"
    assert torch_backend("inductor", cpu, {"mode": "max-autotune"}) == "inductor"
    assert torch_backend("inductor", cpu, {"options": {"freezing": True}}) == "inductor"
    assert isinstance(torch_backend("inductor", cpu, {"dynamic": False}), CpuAttentionBackend)
    assert torch_backend("inductor", torch.nn.Linear(2, 2, device="meta")) == "inductor"
