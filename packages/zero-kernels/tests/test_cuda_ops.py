"""CUDA sources compile with nvcc (skipped only without nvcc); kernels equal torch on a GPU (skipped without CUDA);
the torch references of blockwise quantization and FusedAdam are checked on CPU everywhere."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import zero_kernels as zk
from zero_kernels.loader import CSRC
from zero_kernels.quantize import dequantize_blockwise_reference, quantize_blockwise_reference

CUDA_SOURCES = sorted((CSRC / "cuda").glob("*.cu"))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("src", CUDA_SOURCES, ids=lambda p: p.name)
def test_cuda_sources_compile_with_nvcc(src, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    # sm_90 machine code, plus compute_80 PTX that the driver can JIT for any newer GPU.
    cmd = [nvcc, "-c", str(src), "-o", str(tmp_path / (src.stem + ".o")), "-std=c++17", "-O3", f"-I{CSRC}",
           "-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_80,code=compute_80"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / (src.stem + ".o")).stat().st_size > 0


def test_quantize_reference_exact_small_case():
    x = torch.tensor([0.5, -1.0, 0.25, 0.0, 3.0, 1.5])  # block 4: [0.5,-1,0.25,0], [3,1.5,pad,pad]
    data, scales = quantize_blockwise_reference(x, 8, 4)
    torch.testing.assert_close(scales, torch.tensor([1.0 / 127, 3.0 / 127]), rtol=0, atol=0)
    assert data.tolist() == [64, -127, 32, 0, 127, 64, 0, 0]  # round(63.5)=64 (half to even), round(31.75)=32
    # int4 with exact scales (absmax 7 -> scale 1): q = [4, -7, 2, 0 | 7, 2, pad 0, pad 0] (3.5 -> 4 and 2.5 -> 2,
    # half to even); stored as q + 8 with the even index in the low nibble.
    data4, scales4 = quantize_blockwise_reference(torch.tensor([3.5, -7.0, 1.75, 0.0, 7.0, 2.5]), 4, 4)
    assert data4.dtype == torch.uint8 and data4.tolist() == [12 | 1 << 4, 10 | 8 << 4, 15 | 10 << 4, 8 | 8 << 4]
    assert scales4.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 7, 4096, 10_001])
def test_quantize_reference_roundtrip_bound(bits, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    block = 256
    data, scales = quantize_blockwise_reference(x, bits, block)
    back = dequantize_blockwise_reference(data, scales, numel, bits, block)
    per_elem_scale = scales.repeat_interleave(block)[:numel]
    assert back.shape == (numel,) and (back - x).abs().le(per_elem_scale / 2 + 1e-7).all()
    assert zk.quantize_blockwise(x, bits, block)[0].equal(data)  # CPU tensors take the reference path


def test_quantize_rejects_bad_parameters():
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 3"):
        zk.quantize_blockwise(torch.zeros(4), 3, 4)
    with pytest.raises(ValueError, match=r"block must be a positive int \(even for int4\), got 5"):
        zk.quantize_blockwise(torch.zeros(4), 4, 5)


def test_fused_adam_without_cuda_matches_torch():
    ours = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (3, 1000)]
    ref = [p.clone() for p in ours]
    opt, ref_opt = zk.FusedAdam(ours, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        for a, b in zip(ours, ref):
            a.grad = torch.full_like(a, 0.1 * step - 0.2)
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("adamw", [True, False])
def test_fused_adam_cuda_matches_torch(adamw):
    assert zk.available("cuda_ops")
    sizes = (1, 7, 1000, 4097, 70_000)  # tails and a tensor spanning several chunks
    ours = [torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(n)) for n in sizes]
    ours.append(torch.randn(20_001, device="cuda")[1:])  # 4 bytes past an aligned start: the unvectorised path
    ref = [p.clone() for p in ours]
    opt = zk.FusedAdam(ours, lr=1e-3, weight_decay=0.1, adamw_mode=adamw)
    ref_opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ref, lr=1e-3, weight_decay=0.1, foreach=False)
    for step in range(100):
        for a, b in zip(ours, ref):
            a.grad = torch.randn(a.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            b.grad = a.grad.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        # after 100 fp32 steps the two kernels' roundings (FMA contraction) differ by a few ulps, no more
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_cuda
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 7, 4096, 100_003])
def test_quantize_cuda_equals_reference(bits, numel):
    assert zk.available("cuda_ops")
    x = torch.randn(numel, device="cuda", generator=torch.Generator("cuda").manual_seed(numel))
    x[: min(numel, 3)] = 0.0
    data, scales = zk.quantize_blockwise(x, bits, 512)
    ref_data, ref_scales = quantize_blockwise_reference(x, bits, 512)
    assert torch.equal(scales, ref_scales) and torch.equal(data, ref_data)
    back = zk.dequantize_blockwise(data, scales, numel, bits, 512)
    assert torch.equal(back, dequantize_blockwise_reference(ref_data, ref_scales, numel, bits, 512))
