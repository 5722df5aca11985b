"""ZeRO-Inference's memory promise: a Llama built under ``zero.Init`` (each rank holds 1/world of the weights) and
wrapped by ``zero.initialize`` at stage 3 without an optimizer must never hold the whole model while it is built
(each module is partitioned as its ``__init__`` returns, Hugging Face's ``post_init`` initialising the partitioned
weights one at a time), must not hold a second copy of the model while the partitioned weights move into the
engine's shards, must give the freed full values back to the OS once built, and a forward must grow each rank by
about one gathered unit. Measured from /proc/self/status on 2 gloo ranks: the peak resident growth of the build,
of ``initialize`` and of each forward (VmHWM after, reset just before, minus VmRSS before) and RSS after the build;
the wrapped model's weights equal bitwise, and its logits equal, those of the same model built densely from the
same seed."""

import hashlib
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


def _peak_growth(fn):
    """(fn's result, this process's peak resident growth while it ran, bytes)."""
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = _status("VmRSS")
    out = fn()
    return out, _status("VmHWM") - before


def init_memory_body() -> dict:
    torch.set_num_threads(1)
    # one unit live at a time (DeepSpeed's default max_live, 1e9, lets the prefetch gather this whole model)
    cfg = {"train_micro_batch_size_per_gpu": 1,
           "zero_optimization": {"stage": 3, "stage3_unit_numel": UNIT_NUMEL,
                                 "stage3_max_live_parameters": UNIT_NUMEL}}  # fmt: skip
    with torch.device("meta"):
        _llama()  # the modeling code's first-use pages, before the baseline
    before_build = _status("VmRSS")
    model, build_peak = _peak_growth(lambda: _build_under_init(cfg))
    built = _status("VmRSS") - before_build
    largest_module = max(sum(p.ds_numel * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    (engine, *_), growth = _peak_growth(lambda: zero.initialize(model=model, config=cfg))
    model_bytes = sum(p.ds_numel * 4 for p in engine.module.parameters())
    largest_unit = max(sum(p.ds_numel * 4 for p in m.parameters()) for m in (*model.model.layers, model.lm_head))
    ids = torch.randint(0, 8192, (1, 16), generator=torch.Generator().manual_seed(1))
    engine.eval()
    forwards = []
    for _ in range(3):  # the first pass records the unit order; the next ones prefetch along it
        with torch.no_grad():
            logits, grown = _peak_growth(lambda: engine(input_ids=ids).logits)
        forwards.append(grown)
    with zero.zero.GatheredParameters(list(engine.module.parameters())):
        digests = _digests(engine.module)
    return {"growth": growth, "model_bytes": model_bytes, "logits": logits, "ids": ids, "built": built,
            "forwards": forwards, "largest_unit": largest_unit, "build_peak": build_peak,
            "largest_module": largest_module, "digests": digests}  # fmt: skip


def _build_under_init(cfg: dict):
    with zero.zero.Init(config_dict_or_path=cfg):
        return _llama()


def _digests(model) -> dict[str, str]:
    """Each parameter's bytes, hashed (of a copy: numpy pins the storage a stage-3 unit frees): bitwise equality
    without shipping the weights between processes."""
    return {n: hashlib.sha1(p.detach().clone().numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}


def test_initialize_of_a_zero_init_model_adds_no_model_copy_to_the_peak():
    results = run_ranks(init_memory_body, 2, timeout=240)
    dense = _llama().eval()
    with torch.no_grad():
        ref = dense(input_ids=results[0]["ids"]).logits
    for rank, out in enumerate(results):
        model_bytes = out["model_bytes"]
        assert model_bytes > 120 << 20, model_bytes  # ~135 MiB fp32: big enough to tell a copy from noise
        # the build: this rank's shard, plus the largest module's own weights (the embedding, 16 MiB) whole while
        # it is partitioned or initialised (each rank draws the full tensor and keeps its shard), with room for one
        # more; partitioning the model only once it is whole would grow by the whole model
        largest = out["largest_module"]
        assert 8 << 20 < largest < 0.15 * model_bytes, largest
        bound = model_bytes / 2 + 2 * largest + (8 << 20)
        assert out["build_peak"] < bound, (rank, out["build_peak"] >> 20, int(bound) >> 20, model_bytes >> 20)
        assert out["digests"] == _digests(dense), rank  # the random initialisation, bitwise
        # the shard written while the zero_init pieces are still held adds at least model_bytes / 2; giving the
        # pieces back unit by unit leaves a unit's buffers (here ~40 MiB for the embedding's unit) and noise
        assert out["growth"] < 0.45 * model_bytes, (rank, out["growth"] >> 20, model_bytes >> 20)
        # built: this rank's records (model_bytes / 2) resident, the freed full values given back to the OS
        assert out["built"] < 0.7 * model_bytes, (rank, out["built"] >> 20, model_bytes >> 20)
        # each forward: the one unit gathered (the head's, 16 MiB, is the largest) and a 16-token forward's
        # activations (under 1 MiB; the first forward also pays torch's first-use allocations, about 13 MiB), not
        # heap pages kept after units were released nor units prefetched past max_live
        unit, grown = out["largest_unit"], out["forwards"]
        assert 8 << 20 < unit < 0.15 * model_bytes, unit
        shown = (rank, [f >> 20 for f in grown], unit >> 20)
        assert grown[0] < unit + (20 << 20) and max(grown[1:]) < unit + (6 << 20), shown
        torch.testing.assert_close(out["logits"], ref, rtol=1e-5, atol=1e-5)
