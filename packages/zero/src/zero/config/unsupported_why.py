"""Why each top-level DeepSpeed section that zero rejects is rejected, and what to use instead (one line each).

``zero.config.legacy.reject_unsupported`` appends the line to its NotSupportedError; README's config section lists
the same table.
"""

from __future__ import annotations

WHY = {
    "pipeline": "the section applies to a PipelineModule model (deepspeed.pipe); this model is not one",
    "moe": "no moe config section; expert parallelism is set by deepspeed.moe.layer.MoE's arguments (ep_size, ...) "
    "or, for a transformers MoE model, by the expert_parallel section (AutoEP)",
    "sparse_attention": "no block-sparse attention kernels; use torch's scaled_dot_product_attention in the model",
    "curriculum_learning": "no curriculum data sampler; order the data in your own DataLoader",
    "data_efficiency": "no data sampling/routing library; filter and order the data in your own DataLoader",
    "amp": "NVIDIA Apex AMP (DeepSpeed removed it too); use torch_autocast, bf16 or fp16",
    "compression_training": "no quantization-aware training or pruning; use torch.ao.quantization on the model",
    "autotuning": "no autotuner; set batch and bucket sizes by hand (measured settings in docs/benchmarks.md)",
    "elasticity": "no elastic batch sizes; use torchrun --nnodes MIN:MAX with a fixed batch triple",
    "aio": "no NVMe offload in the engine yet; train without offload (zero_optimization.offload_* device none)",
    "nebula": "Azure's Nebula checkpoint service; use save_checkpoint (zero_core's sharded safetensors format)",
    "compile": "zero-compile is not wired into the engine yet; call torch.compile(model) before initialize()",
    "quantize_training": "no MoQ quantized training; train in bf16, fp16 or with torch_autocast",
    "eigenvalue": "no Hessian eigenvalue estimation (it serves MoQ); remove the section",
    "progressive_layer_drop": "no progressive layer drop; skip layers in the model's own forward",
    "weight_quantization": "no inference weight quantization; quantize after training with torch.ao.quantization",
    "sparse_gradients": "no sparse all-reduce for embedding gradients; gradients are reduced dense",
    "dataloader_drop_last": "initialize()'s loader keeps the last batch; pass batches from DataLoader(drop_last=True)",
}


def why(key: str) -> str:
    """``"; <reason and alternative>"`` for a rejected section ``key`` (empty when none is recorded)."""
    return f"; {WHY[key]}" if key in WHY else ""
