"""A transformers decoder-only model split into pipeline stages by ``zero_parallel.pipe.decoder_layers`` (no
LayerSpecs written), trained with ``zero.initialize`` + ``train_batch`` on 2 stages (2 gloo ranks), equals the
model trained in one process on the same micro-batches with gradient accumulation: the loss each step (the model's
own ``labels=`` loss) and every parameter of each stage by its transformers name (fp32, 1e-6 relative).

* a tiny Llama (untied head, SDPA attention), AdamW with ZeRO-1;
* a tiny Qwen3 whose head is tied to its embedding (held by both stages), eager attention, the zero-bubble schedule;
* a tiny Qwen2 (tied, SDPA) through 1F1B with SGD;
* the tiny Llama with its stages' layers compiled by ``engine.compile()`` (inductor), and the tied Qwen2 compiled
  by the config's ``torch_compile.enabled`` with activation checkpointing every layer: equal to the eager model
  in one process within 1e-5 relative (inductor fuses and reorders float sums, so compiled and eager forwards
  differ by a few fp32 roundings per op; 1e-6 holds only where both run the same kernels); compiling a
  zero-bubble pipeline is refused on every rank;
* the tiny Llama with the ``bf16`` section on and its layers compiled by ``engine.compile()``: the compile goes
  through zero_compile's cpu_attention pass (each stage's bf16 attention shape timed, its choice recorded), and the
  losses equal the fp32 model's in one process within 1e-3 relative (the parameters are not compared: AdamW's
  first steps move each weight by about the learning rate whatever its gradient, so bf16 gradients give
  parameters 1-10% off the fp32 ones at this size).
"""

import copy

import pytest
import torch
from torch import nn

import zero
from zero.config import NotSupportedError
from zero_comm.testing import run_ranks
from zero_parallel.pipe import PipelineModule, causal_lm_loss, decoder_layers

VOCAB, SEQ, MICRO, GAS, STEPS = 48, 8, 2, 3, 2


def _model(kind: str) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": SEQ}  # fmt: skip
    torch.manual_seed(7)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False, attn_implementation="sdpa"))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=4, tie_word_embeddings=True, attn_implementation="eager"))
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True, attn_implementation="sdpa"))


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, eps=1e-6, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _ids(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check(kind: str, opt: str, stage: int, schedule: str, compiled: str = "", interval: int = 0,
           bf16: bool = False) -> None:  # fmt: skip
    """Train ``kind`` on 2 stages and compare with one process; ``compiled``: "engine" (``engine.compile()``) or
    "config" (``torch_compile.enabled``) compiles the stages' layers; ``interval``: activation checkpointing;
    ``bf16``: the bf16 section on (compared with the fp32 process)."""
    model = _model(kind)
    ref = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    module = PipelineModule(decoder_layers(model), num_stages=2, loss_fn=causal_lm_loss)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
              "pipeline": {"schedule": schedule, "activation_checkpoint_interval": interval}}  # fmt: skip
    if compiled == "config":
        config["torch_compile"] = {"enabled": True, "backend": "inductor"}
    if bf16:
        config["bf16"] = {"enabled": True}
    tol = 1e-3 if bf16 else 1e-5 if compiled else 1e-6  # see the module notes
    mine = {}  # this stage's parameters by transformers name
    for name, p in module.named_parameters():
        mine["model.embed_tokens.weight" if name.startswith("tied_modules.embed") else names[id(p)]] = p
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer(opt, ps), config=config)
    if compiled == "engine":
        engine.compile()
    assert module.layers_compiled == bool(compiled)
    ref_opt = _optimizer(opt, ref.parameters())
    for step in range(STEPS):
        batches = [(_ids(step, m), _ids(step, m)) for m in range(GAS)]
        loss = float(engine.train_batch(iter(batches)))
        total = 0.0
        for ids, labels in batches:
            out = ref(input_ids=ids, labels=labels).loss
            (out / GAS).backward()
            total += float(out.detach())
        ref_opt.step()
        ref_opt.zero_grad()
        want = total / GAS
        assert abs(loss - want) <= tol * abs(want), f"{kind} step {step}: loss {loss} != one process's {want}"
    if bf16:  # AdamW's first steps move a weight by ~lr whatever its gradient: bf16 rounding shows as 1-10%
        return
    theirs = dict(ref.named_parameters())
    assert "model.embed_tokens.weight" in mine if engine.is_first_stage() else "model.norm.weight" in mine
    for name, p in mine.items():
        err = _rel(p.detach(), theirs[name].detach())
        assert err <= tol, f"{kind} stage {engine.stage_id}: {name} relative error {err:.3g}"


def _two_ranks() -> None:
    _check("llama", "adamw", 1, "1f1b")
    _check("qwen3", "adamw", 1, "zero_bubble")
    _check("qwen2", "sgd", 0, "1f1b")
    _check("llama", "adamw", 1, "1f1b", compiled="engine")
    _check("qwen2", "adamw", 1, "1f1b", compiled="config", interval=1)
    _bf16_compiled_check()
    _compile_refusals()


def _bf16_compiled_check() -> None:
    """bf16 layers compiled by ``engine.compile()`` on CPU: zero_compile's cpu_attention pass timed each stage's
    bf16 attention shape (``[micro, heads, seq, head_dim]``, the key and value with their 2 heads)."""
    from zero_compile.passes import cpu_attention

    cpu_attention._CHOICES.clear()
    _check("llama", "adamw", 1, "1f1b", compiled="engine", bf16=True)
    shapes = [(s.query, s.key, s.dtype) for s in cpu_attention._CHOICES]
    assert shapes == [((MICRO, 4, SEQ, 4), (MICRO, 2, SEQ, 4), torch.bfloat16)], shapes


def _compile_refusals() -> None:
    """Compiling the zero-bubble schedule's layers (their Linear weight gradients deferred) raises on every rank."""
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "zero_optimization": {"stage": 1}, "pipeline": {"schedule": "zero_bubble"}}  # fmt: skip
    module = PipelineModule(decoder_layers(_model("llama")), num_stages=2, loss_fn=causal_lm_loss)
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps), config=config)
    with pytest.raises(NotSupportedError, match=r"engine\.compile\(\) with pipeline\.schedule 'zero_bubble'"):
        engine.compile()
    module = PipelineModule(decoder_layers(_model("llama")), num_stages=2, loss_fn=causal_lm_loss)
    with pytest.raises(NotSupportedError, match=r"'torch_compile\.enabled': true with pipeline\.schedule"):
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps),
                        config={**config, "torch_compile": {"enabled": True}})  # fmt: skip


def test_transformers_models_split_into_two_stages_train_as_one_process():
    run_ranks(_two_ranks, 2, timeout=240)
