"""The cpu_attention pass and ``CpuAttentionBackend``, in one process: a bf16 or fp16 attention on CPU compiled
with the pass moved to fp32 gives exactly the eager fp32-upcast attention (output and the input gradients,
``aot_eager``), and exactly the reduced-precision kernel when the choice keeps it; fp32 attention and dynamic
shapes are left alone; the choice is timed once per shape and process, the fp32 way taken only past the margin;
long shapes are timed by one run of each way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zero_compile.cpu_backend import CpuAttentionBackend
from zero_compile.passes import cpu_attention as ca


class _Attention(torch.nn.Module):
    """``[b, s, 16]`` -> ``[b, s, 16]``: 4 query heads of size 4 and 2 key/value heads (grouped-query), causal or
    with an additive float mask, in the dtype of its input."""

    def __init__(self, masked: bool = False):
        super().__init__()
        self.masked = masked
        self.q = torch.nn.Linear(16, 16)
        self.kv = torch.nn.Linear(16, 16)

    def forward(self, x, upcast: bool = False):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 4).permute(2, 0, 3, 1, 4)
        mask = None
        if self.masked:
            mask = torch.full((s, s), -1e4, dtype=x.dtype).triu(1)
        if upcast:  # the reference: what the pass makes of the call
            mask = None if mask is None else mask.float()
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                 is_causal=not self.masked, enable_gqa=True).to(x.dtype)  # fmt: skip
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.masked, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, s, -1)


def _run(module, x, **kwargs):
    x = x.clone().requires_grad_()
    out = module(x, **kwargs)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


def _compiled(module, choose, dynamic=False):
    backend = CpuAttentionBackend("aot_eager", choose=choose)
    return torch.compile(module, backend=backend, dynamic=dynamic), backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masked", [False, True])
def test_reduced_precision_attention_moved_to_fp32_equals_the_upcast_attention(dtype, masked):
    torch.manual_seed(0)
    module = _Attention(masked).to(dtype)
    x = torch.randn(2, 8, 16, dtype=dtype)
    seen = []
    compiled, backend = _compiled(module, lambda shape: seen.append(shape) or True)
    out, grad = _run(compiled, x)
    want_out, want_grad = _run(module, x, upcast=True)
    assert backend.notes == [{"cpu_attention": {"fp32": 1, "kept": 0}}]
    assert seen == [ca.AttentionShape((2, 4, 8, 4), (2, 2, 8, 4), (2, 2, 8, 4), dtype,
                                      ((8, 8), dtype) if masked else None, not masked, None, True)]  # fmt: skip
    assert out.dtype == dtype and torch.equal(out, want_out)
    assert torch.equal(grad, want_grad)
    for name, p in module.named_parameters():  # the parameters' gradients too (accumulated over both runs)
        assert p.grad is not None, name
    native_out, _ = _run(module, x)
    assert not torch.equal(native_out, want_out)  # the two ways differ, so the equality above says which ran


def test_attention_kept_when_the_choice_keeps_it_or_not_reduced_or_dynamic():
    torch.manual_seed(0)
    module = _Attention().to(torch.bfloat16)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    compiled, backend = _compiled(module, lambda shape: False)
    out, grad = _run(compiled, x)
    want_out, want_grad = _run(module, x)
    assert backend.notes == [{"cpu_attention": {"fp32": 0, "kept": 1}}]
    assert torch.equal(out, want_out) and torch.equal(grad, want_grad)

    asked = []
    compiled, backend = _compiled(_Attention(), lambda shape: asked.append(shape) or True)  # fp32: nothing to do
    _run(compiled, torch.randn(2, 8, 16))
    assert backend.notes == [{"cpu_attention": {"fp32": 0, "kept": 0}}] and asked == []

    compiled, backend = _compiled(module, lambda shape: asked.append(shape) or True, dynamic=True)
    out, _ = _run(compiled, x)
    assert backend.notes == [{"cpu_attention": {"fp32": 0, "kept": 0}}] and asked == []  # symbolic sizes
    assert torch.equal(out, want_out)


def test_choice_is_timed_once_per_shape_and_needs_the_margin(monkeypatch):
    monkeypatch.setattr(ca, "_CHOICES", {})
    calls = []

    def timer(times):
        return lambda shape: calls.append(shape) or times

    shape = ca.AttentionShape((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), torch.bfloat16, None, True, None, False)
    other = ca.AttentionShape((1, 2, 16, 4), (1, 2, 16, 4), (1, 2, 16, 4), torch.bfloat16, None, True, None, False)
    assert ca.fp32_is_faster(shape, timer((1.0, 0.5)))
    assert ca.fp32_is_faster(shape, timer((1.0, 2.0)))  # decided: not timed again
    assert not ca.fp32_is_faster(other, timer((1.0, 0.95)))  # within the margin: the kernel is kept
    assert calls == [shape, other]


def test_time_both_measures_both_ways_once_at_long_shapes(monkeypatch):
    shape = ca.AttentionShape((1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), torch.bfloat16, ((8, 8), torch.bfloat16),
                              False, 0.5, False)  # fmt: skip
    native, fp32 = ca.time_both(shape, rounds=3)
    assert 0 < native < 1 and 0 < fp32 < 1
    monkeypatch.setattr(ca, "LONG_S", 0.0)
    runs = []
    monkeypatch.setattr(ca, "_run", lambda shape, fp32: runs.append(fp32) or (0.5 if fp32 else 1.0))
    assert ca.time_both(shape, rounds=3) == (1.0, 0.5)
    assert runs == [False, False, True]  # warm-up, then one run each: the kernel's took more than LONG_S


def test_backend_refuses_an_unknown_inner_compiler():
    with pytest.raises(ValueError, match="compile backend must be one of"):
        CpuAttentionBackend("tvm")
