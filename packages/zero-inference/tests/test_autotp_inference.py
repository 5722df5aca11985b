"""``init_inference`` with ``tensor_parallel.tp_size = 2`` on 2 gloo ranks against the same model in one process.

Three tiny transformers models built from configs (2 layers, fp32): Llama (4 heads over 2 key-value heads, untied
LM head), Qwen2 (biases on q/k/v) and Qwen3 (per-head q/k norms, tied embeddings). On every rank the logits equal
the unsplit model's (1e-5) and greedy ``generate`` with the KV cache gives the same tokens as one process, the
cache holding this rank's key-value head only. Likewise: DeepSpeed's ``injection_policy`` on a given ``tp_group``
and AutoTP over an ``mpu``'s group (logits); ``replace_with_kernel_inject`` (fused blocks over the shards, a static
KV cache: the same tokens for left-padded prompts, and through the engine's own decode loop for unpadded ones); a
model built on the meta device whose weights are read from a checkpoint, each rank reading its shards
(transformers' safetensors shards, or DeepSpeed's description of torch files), and for a 130 MB checkpoint the
peak resident memory each rank gains while loading it: its shard plus one layer, with or without the fused blocks,
against the whole model loaded at tp=1 (which exceeds that bound). Then the errors, raised on every
rank: a tp_size that does not divide the world size or the key-value heads, a dtype the CPU cannot run, a bad
``generate`` argument on one rank, a checkpoint file that does not exist, and ``generate`` called on one rank only
(a named error after the engine's timeout, not a hang).
All in one ``run_ranks`` launch.
"""

import ctypes
import gc
import json
import pathlib
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from zero_comm.testing import run_ranks
from zero_inference import InferenceEngine, PartialGenerateError, init_inference
from zero_parallel import ColumnParallelLinear, RowParallelLinear

TP = 2
COMMON = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, tie_word_embeddings=False)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True)),
}


def _build(name: str, **overrides) -> torch.nn.Module:
    """The same weights on every rank (seeded); ``overrides`` change the config."""
    torch.manual_seed(0)
    if overrides:
        cfg = {**COMMON, **overrides}
        return LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    return MODELS[name]().eval()


def _prompt() -> torch.Tensor:
    return torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          use_cache=True, pad_token_id=0)  # fmt: skip


def _one_model(name: str) -> dict:
    ids = _prompt()
    reference = _build(name)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits
        ref_tokens = _greedy(reference, ids)
    engine = init_inference(_build(name), tensor_parallel={"tp_size": TP}, dtype=torch.float32)
    with torch.no_grad():
        out = engine(input_ids=ids, use_cache=True)
        tokens = engine.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, use_cache=True, pad_token_id=0)  # fmt: skip
    attn = engine.module.model.layers[0].self_attn
    return {"logit_err": (out.logits - ref_logits).abs().max().item(), "tokens": tokens.tolist(),
            "ref_tokens": ref_tokens.tolist(), "cache_kv_heads": out.past_key_values.layers[0].keys.shape[1],
            "q_rows": attn.q_proj.weight.shape[0], "column": isinstance(attn.q_proj, ColumnParallelLinear),
            "row": isinstance(engine.module.model.layers[0].mlp.down_proj, RowParallelLinear),
            "engine": isinstance(engine, InferenceEngine) and isinstance(engine.module, type(reference)),
            "group": dist.get_process_group_ranks(engine.mp_group)}  # fmt: skip


class _ModelParallelUnit:
    """A user's mpu (Megatron style): its model-parallel group is the tensor-parallel group."""

    def __init__(self, group):
        self.group = group

    def get_model_parallel_group(self):
        return self.group


def _injection_policy() -> dict:
    """DeepSpeed's user-given policy: the decoder layer's row-parallel Linears named, over a given tp_group; then
    AutoTP over the group of the deprecated top-level ``mpu``."""
    ids = _prompt()
    with torch.no_grad():
        ref_logits = _build("llama")(input_ids=ids).logits
    group = dist.new_group([0, 1])
    by_mpu = init_inference(_build("llama"), mpu=_ModelParallelUnit(group), dtype="fp32")
    with torch.no_grad():
        mpu_err = (by_mpu(input_ids=ids).logits - ref_logits).abs().max().item()
    policy = {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}
    engine = init_inference(_build("llama"), injection_policy=policy, tp={"tp_group": dist.new_group([0, 1])},
                            dtype="fp32")  # fmt: skip
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    layer = engine.module.model.layers[1]
    return {
        "logit_err": (logits - ref_logits).abs().max().item(),
        "source": engine.layout.source,
        "mpu_err": mpu_err,
        "mpu_group": by_mpu.mp_group is group and by_mpu._config.tensor_parallel.tp_size == TP,
        "split": (
            isinstance(layer.self_attn.k_proj, ColumnParallelLinear),
            isinstance(layer.mlp.down_proj, RowParallelLinear),
            isinstance(engine.module.lm_head, nn.Linear),
        ),
    }


def _from_checkpoint(name: str, checkpoint, base_dir: str = "") -> dict:
    """A model built on the meta device, its weights read from ``checkpoint`` shard by shard at tp=2."""
    ids = _prompt()
    reference = _build(name)
    with torch.no_grad():
        ref_logits = reference(input_ids=ids).logits
    with torch.device("meta"):
        model = MODELS[name]()
    engine = init_inference(model, tp={"tp_size": TP}, dtype="fp32", checkpoint=checkpoint, base_dir=base_dir)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    held = {id(p): p.numel() for p in engine.module.parameters()}
    return {
        "logit_err": (logits - ref_logits).abs().max().item(),
        "held": sum(held.values()),
        "full": sum(p.numel() for p in reference.parameters()),
    }


BIG = {"vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 16,
       "num_attention_heads": 6, "num_key_value_heads": 6, "max_position_embeddings": 64,
       "tie_word_embeddings": False}  # fmt: skip
"""A Llama of 33M parameters (132 MB in fp32): 16 layers of 7 MB, an embedding and an LM head of 12.6 MB each."""
RSS_SLACK = 8 * 2**20
"""Bytes a rank's peak may exceed its shard plus the largest file: the allocator's and Python's own growth."""


def _write_big_checkpoint(folder: pathlib.Path) -> None:
    """:data:`BIG` with seeded random weights as transformers' safetensors folder, one file per decoder layer (the
    embedding and the LM head with the final norm one file each), written file by file."""
    folder.mkdir()
    with torch.device("meta"):
        names = {n: t.shape for n, t in LlamaForCausalLM(LlamaConfig(**BIG)).state_dict().items()}
    parts: dict[str, list[str]] = {}
    for name in names:
        part = name.split(".")[2] if name.startswith("model.layers.") else "embed" if "embed" in name else "head"
        parts.setdefault(part, []).append(name)
    gen, weight_map = torch.Generator().manual_seed(0), {}
    for i, keys in enumerate(parts.values()):
        file = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: torch.randn(names[k], generator=gen) * 0.02 for k in keys}, str(folder / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak_growth(load) -> tuple[int, int]:
    """(peak resident bytes gained while ``load()`` runs, its result): freed heap returned to the system first
    (glibc's malloc_trim), then the high-water mark reset to the current resident size (Linux's clear_refs)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_bytes("VmRSS")
    held = load()
    return _status_bytes("VmHWM") - before, held


def _load_held_bytes(folder: str, tp_size: int, inject: bool = False) -> int:
    """Bytes of the parameters and buffers a meta-device :data:`BIG` holds after ``folder`` is loaded at ``tp_size``
    (its decoder layers then replaced by fused blocks with ``inject``)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**BIG))
    engine = init_inference(model, tp={"tp_size": tp_size}, dtype="fp32", checkpoint=folder,
                            replace_with_kernel_inject=inject)  # fmt: skip
    tensors = {t.data_ptr(): t.nbytes for t in [*engine.module.parameters(), *engine.module.buffers()]}
    return sum(tensors.values())


def _sharded_load_rss(folder: str) -> dict:
    """Peak RSS gained loading the big checkpoint at tp=2, then at tp=2 with ``replace_with_kernel_inject``, then
    whole (tp=1) as the case that must break the bound."""
    shard_growth, shard = _peak_growth(lambda: _load_held_bytes(folder, TP))
    fused_growth, fused = _peak_growth(lambda: _load_held_bytes(folder, TP, inject=True))
    whole_growth, whole = _peak_growth(lambda: _load_held_bytes(folder, 1))
    largest = max(f.stat().st_size for f in pathlib.Path(folder).glob("*.safetensors"))
    return {"shard_growth": shard_growth, "shard": shard, "whole_growth": whole_growth, "whole": whole,
            "fused_growth": fused_growth, "fused": fused, "bound": shard + largest + RSS_SLACK}  # fmt: skip


def _fused_blocks() -> dict:
    """``replace_with_kernel_inject`` at tp=2: fused blocks over the rank's shards, left-padded prompts."""
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is 3 tokens, left-padded
    reference = _build("llama")
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        ref_tokens = reference.generate(input_ids=ids, **kwargs)
    engine = init_inference(_build("llama"), tp={"tp_size": TP}, dtype="fp32", replace_with_kernel_inject=True)
    with torch.no_grad():
        out = engine.generate(input_ids=ids, return_dict_in_generate=True, **kwargs)
    return {"tokens": out.sequences.tolist(), "ref_tokens": ref_tokens.tolist(),
            "blocks": sorted({type(m).__name__ for m in engine.module.model.layers}),
            "cache": type(out.past_key_values).__name__}  # fmt: skip


def _own_loop() -> dict:
    """``replace_with_kernel_inject`` at tp=2, an unpadded prompt: the engine's own decode loop over the shards."""
    ids = _prompt()
    with torch.no_grad():
        ref_tokens = _greedy(_build("llama"), ids)
    engine = init_inference(_build("llama"), tp={"tp_size": TP}, dtype="fp32", replace_with_kernel_inject=True)
    with torch.no_grad():
        tokens = _greedy(engine, ids)
    return {"tokens": tokens.tolist(), "ref_tokens": ref_tokens.tolist(), "own": engine._decode_loop.cache is not None}


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors() -> dict:
    rank = dist.get_rank()
    out = {
        "ranks": _error(lambda: init_inference(_build("llama"), tp={"tp_size": 3}, dtype="fp32")),
        "heads": _error(
            lambda: init_inference(
                _build("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=48), mp_size=2, dtype="fp32"
            )
        ),  # fmt: skip
        "dtype": _error(lambda: init_inference(_build("llama"), tensor_parallel={"tp_size": 2}, dtype=torch.int8)),
    }
    engine = init_inference(_build("llama"), tensor_parallel={"tp_size": TP}, dtype=torch.float32)
    ids = _prompt()
    beams = 2 if rank == 1 else 1
    try:
        engine.generate(input_ids=ids, max_new_tokens=2, num_beams=beams)
    except NotImplementedError as e:  # DeepSpeed's class for it, on both ranks
        out["beams"] = f"{type(e).__name__}: {e}"
    engine.sync_timeout = 1.0
    if rank == 0:
        start = time.monotonic()
        try:
            engine.generate(input_ids=ids, max_new_tokens=2)
        except PartialGenerateError as e:
            out["partial"] = (str(e), e.missing, time.monotonic() - start)
    else:
        time.sleep(3.0)  # never calls generate while rank 0 waits
    return out


def _body(folder: str, parts: str, big: str) -> dict:
    description = {"type": "ds_model", "checkpoints": ["part0.pt", "part1.pt"], "version": 1.0}
    out = {name: _one_model(name) for name in MODELS}
    out["policy"] = _injection_policy()
    out["fused"] = _fused_blocks()
    out["own_loop"] = _own_loop()
    out["rss"] = _sharded_load_rss(big)
    out["safetensors"] = _from_checkpoint("llama", folder)
    out["ds_json"] = _from_checkpoint("qwen3", description, base_dir=parts)
    out["errors"] = _errors()
    out["errors"]["missing_file"] = _error(lambda: _from_checkpoint("llama", {**description, "checkpoints": ["x.pt"]}))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """The checkpoints are written here first: Llama by ``save_pretrained`` in several safetensors shards, Qwen3
    (tied embeddings) as two torch files that DeepSpeed's checkpoint description lists; the big Llama file by file."""
    root = tmp_path_factory.mktemp("checkpoints")
    _build("llama").save_pretrained(root / "llama", max_shard_size="40KB")
    state = _build("qwen3").state_dict()
    keys = sorted(state)
    (root / "qwen3").mkdir()
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
        torch.save({k: state[k] for k in part}, root / "qwen3" / f"part{i}.pt")
    _write_big_checkpoint(root / "big")
    return run_ranks(_body, TP, str(root / "llama"), str(root / "qwen3"), str(root / "big"), timeout=300,
                     pg_timeout=60)  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tp2_logits_and_greedy_tokens_equal_one_process(results, name):
    for rank, res in enumerate(results):
        r = res[name]
        assert r["logit_err"] <= 1e-5, (rank, r["logit_err"])
        assert r["tokens"] == r["ref_tokens"], rank
        assert r["cache_kv_heads"] == 1 and r["q_rows"] == 16  # 1 of 2 key-value heads, 2 of 4 heads
        assert r["column"] and r["row"] and r["engine"] and r["group"] == [0, 1]
    assert results[0][name]["tokens"] == results[1][name]["tokens"]


def test_injection_policy_splits_the_named_layers_by_rows(results):
    for res in results:
        p = res["policy"]
        assert p["logit_err"] <= 1e-5 and p["source"] == "injection_policy" and p["split"] == (True, True, True), p
        assert p["mpu_err"] <= 1e-5 and p["mpu_group"], p


@pytest.mark.parametrize("source", ["safetensors", "ds_json"])
def test_a_checkpoint_is_loaded_shard_by_shard_into_a_meta_model(results, source):
    for res in results:
        r = res[source]
        assert r["logit_err"] <= 1e-5, r
        assert r["held"] < 0.8 * r["full"], r  # each rank holds its shards of the layers, not the whole model


def test_no_rank_holds_more_than_its_shard_plus_one_layer_while_loading_a_checkpoint(results):
    for res in results:
        r = res["rss"]
        assert r["shard"] < 0.6 * r["whole"], r  # the layers and the LM head split, the embedding whole
        assert r["shard_growth"] < r["bound"], r
        assert r["whole_growth"] > r["bound"], r  # the bound would catch a rank reading the whole model
        # fused blocks: the same shards, concatenated one layer at a time as each layer is replaced
        assert r["fused"] == r["shard"] and r["fused_growth"] < r["bound"], r


def test_fused_blocks_generate_the_tokens_of_the_model(results):
    for res in results:
        f = res["fused"]
        assert f["tokens"] == f["ref_tokens"] and f["blocks"] == ["FusedDecoderBlock"], f
        assert f["cache"] == "StaticCache", f


def test_the_engines_own_decode_loop_gives_the_models_greedy_tokens_at_tp2(results):
    for res in results:
        r = res["own_loop"]
        assert r["tokens"] == r["ref_tokens"] and r["own"], r
    assert results[0]["own_loop"]["tokens"] == results[1]["own_loop"]["tokens"]


def test_clear_errors_on_every_rank(results):
    for res in results:
        e = res["errors"]
        assert e["ranks"].startswith("ValueError: tensor_parallel.tp_size 3 does not divide the world size 2"), e
        assert e["heads"].startswith("ValueError: tensor_parallel.tp_size 2 does not divide the model's 3 key-value"), e
        assert "dtype torch.int8 is not supported on cpu" in e["dtype"], e
        assert e["beams"].startswith("BeamSearchError: InferenceEngine.generate failed on rank 1"), e
        assert "num_beams=2" in e["beams"]
        assert "listed file(s)" in e["missing_file"] and "x.pt" in e["missing_file"], e
    message, missing, waited = results[0]["errors"]["partial"]
    assert missing == [1] and "did not call generate within 1.0 s" in message
    assert waited < 2.5
