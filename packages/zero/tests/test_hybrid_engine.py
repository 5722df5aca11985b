"""The hybrid engine (``hybrid_engine.enabled``) on 2 gloo ranks: ZeRO-3 training of a tiny Llama built from a
config, with greedy rollouts (``engine.generate``) between the steps.

Training with rollouts leaves every parameter bitwise equal to the same training without them. Each rollout's
tokens equal transformers' ``generate`` on the gathered training model, whether the copy generates with the fused
blocks at tp=1, split over both ranks (``inference_tp_size`` 2, each rank with its own prompts), or the training
module generates itself (``pin_parameters`` false); a ZeRO stage 1 engine generates too (DeepSpeed accepts every
stage). Errors: an unknown key, an ``inference_tp_size`` that does not divide the world size, prompts of different
lengths on the ranks of an ``inference_tp_size`` block, and ``generate``
called on one rank only (a named error after the timeout, not a hang). One ``run_ranks`` launch.
"""

import pytest
import torch
import torch.distributed as dist

import zero
from zero.config import ConfigError
from zero.engine.hybrid import HybridEngine, PartialRolloutError
from zero_comm.testing import run_ranks

STEPS = 3


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _cfg(stage: int = 3, **hybrid) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "hybrid_engine": {"enabled": True, **hybrid}}  # fmt: skip


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(100 * step + rank))


def _prompt(rank: int, step: int) -> torch.Tensor:
    return torch.randint(1, 64, (2, 4), generator=torch.Generator().manual_seed(7 + 10 * step + rank))


def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                          pad_token_id=0, eos_token_id=None)  # fmt: skip


def _train(config: dict, rollouts: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """STEPS training steps (a rollout before each when ``rollouts``); the full parameters after, and per
    rollout whether its tokens equal transformers' generate on the gathered training model."""
    rank = dist.get_rank()
    engine, *_ = zero.initialize(model=_tiny_llama(), config=config)
    same = []
    for step in range(STEPS):
        if rollouts:
            prompt = _prompt(rank, step)
            tokens = engine.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                     do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
            with torch.no_grad(), zero.zero.GatheredParameters(list(engine.module.parameters())):
                same.append(torch.equal(tokens, _greedy(engine.module, prompt)))
        seq = _batch(rank, step)
        loss = engine(input_ids=seq, labels=seq).loss
        engine.backward(loss)
        engine.step()
    with zero.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().clone() for p in engine.module.parameters()]
    return params, same


def _errors() -> dict:
    out = {}
    try:
        zero.initialize(model=_tiny_llama(), config=_cfg(bogus=1))
    except ConfigError as e:
        out["unknown_key"] = "bogus" in str(e)
    try:
        zero.initialize(model=_tiny_llama(), config=_cfg(inference_tp_size=3))
    except ValueError as e:
        out["tp_size"] = "inference_tp_size 3" in str(e)
    split, *_ = zero.initialize(model=_tiny_llama(), config=_cfg(inference_tp_size=2))
    try:  # the block generates for both ranks' prompts at once: they must have one shape
        ids = torch.ones(2, 3 + dist.get_rank(), dtype=torch.long)  # 3 tokens on rank 0, 4 on rank 1
        split.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    except ValueError as e:
        out["prompt_shapes"] = "same shape" in str(e)
    engine, *_ = zero.initialize(model=_tiny_llama(), config=_cfg())
    engine.rollout_timeout = 2.0
    if dist.get_rank() == 1:  # rank 0 trains on instead of generating
        prompt = _prompt(1, 0)
        try:
            engine.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
        except PartialRolloutError as e:
            out["partial"] = e.missing
    return out


def hybrid_body() -> dict:
    with_rollouts, same = _train(_cfg(), rollouts=True)
    without, _ = _train(_cfg(), rollouts=False)
    _, same_tp = _train(_cfg(inference_tp_size=2), rollouts=True)
    _, same_unpinned = _train(_cfg(pin_parameters=False), rollouts=True)
    _, same_stage1 = _train(_cfg(stage=1), rollouts=True)
    engine, *_ = zero.initialize(model=_tiny_llama(), config=_cfg())
    return {
        "bitwise": [torch.equal(a, b) for a, b in zip(with_rollouts, without, strict=True)],
        "same": same, "same_tp": same_tp, "same_unpinned": same_unpinned, "same_stage1": same_stage1,
        "kind": isinstance(engine, HybridEngine) and zero.DeepSpeedHybridEngine is HybridEngine,
        "errors": _errors(),
    }  # fmt: skip


@pytest.fixture(scope="module")
def results():
    return run_ranks(hybrid_body, 2, timeout=300)


def test_training_with_rollouts_equals_training_without(results):
    for r in results:
        assert len(r["bitwise"]) == 21 and all(r["bitwise"])  # embed, 2 x (4 attn + 3 mlp + 2 norms), norm, head
        assert r["kind"]


@pytest.mark.parametrize("case", ["same", "same_tp", "same_unpinned", "same_stage1"])
def test_rollout_tokens_equal_generate_on_the_gathered_model(results, case):
    for r in results:
        assert r[case] == [True] * STEPS


def test_clear_errors_on_every_rank(results):
    for r in results:
        assert r["errors"]["unknown_key"] and r["errors"]["tp_size"] and r["errors"]["prompt_shapes"]
    assert results[1]["errors"]["partial"] == [0]
