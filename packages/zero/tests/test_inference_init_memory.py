"""ZeRO-Inference's memory promise at start-up: a Llama built under ``zero.Init`` (each rank holds 1/world of the
weights) and wrapped by ``zero.initialize`` at stage 3 without an optimizer must not hold a second copy of the model
while the partitioned weights move into the engine's shards. Measured as each rank's peak resident growth during
``initialize`` (VmHWM after, reset just before, minus VmRSS before), on 2 gloo ranks; the wrapped model's logits
equal those of the same model built densely from the same seed."""

from pathlib import Path

import torch

import zero
from zero_comm.testing import run_ranks

UNIT_NUMEL = 4_000_000  # one decoder layer (3.2M parameters) per unit


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _status(key: str) -> int:
    """``key`` of /proc/self/status, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line")


def init_memory_body() -> dict:
    torch.set_num_threads(1)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_unit_numel": UNIT_NUMEL}}  # fmt: skip
    with zero.zero.Init(config_dict_or_path=cfg):
        model = _llama()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = _status("VmRSS")
    engine, *_ = zero.initialize(model=model, config=cfg)
    growth = _status("VmHWM") - before
    model_bytes = sum(p.ds_numel * 4 for p in engine.module.parameters())
    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return {"growth": growth, "model_bytes": model_bytes, "logits": logits, "ids": ids}


def test_initialize_of_a_zero_init_model_adds_no_model_copy_to_the_peak():
    results = run_ranks(init_memory_body, 2, timeout=240)
    dense = _llama().eval()
    with torch.no_grad():
        ref = dense(input_ids=results[0]["ids"]).logits
    for rank, out in enumerate(results):
        model_bytes = out["model_bytes"]
        assert model_bytes > 120 << 20, model_bytes  # ~135 MiB fp32: big enough to tell a copy from noise
        # the shard written while the zero_init pieces are still held adds at least model_bytes / 2; giving the
        # pieces back unit by unit leaves a unit's buffers (here ~40 MiB for the embedding's unit) and noise
        assert out["growth"] < 0.45 * model_bytes, (rank, out["growth"] >> 20, model_bytes >> 20)
        torch.testing.assert_close(out["logits"], ref, rtol=1e-5, atol=1e-5)
