"""Generation under ZeRO-3 as TRL's ``unwrap_model_for_generation`` runs it (GRPO, RLOO, online DPO): the whole
model gathered with ``GatheredParameters(engine.parameters())``, DeepSpeed's hooks removed through
``engine.optimizer.parameter_offload``, ``generate()``, hooks re-added, the block left; then a training step on the
generated sequences, whose length changes every round. 2 gloo ranks against a single-process torch run, with the
optimizer on the device and offloaded to CPU Adam."""

import itertools

import pytest
import torch

import zero
from zero_comm.testing import run_ranks

ROUNDS = 3


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _prompt(rank: int, rnd: int) -> torch.Tensor:
    return torch.randint(1, 64, (2, 3 + rnd), generator=torch.Generator().manual_seed(10 * rnd + rank))


def _generate(model, prompt: torch.Tensor, rnd: int) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2 + rnd, do_sample=False,
                          pad_token_id=0, eos_token_id=None)  # fmt: skip


def _cfg(offload: bool) -> dict:
    zo = {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": zo}
    if offload:  # zero's CPU Adam steps the host copy
        zo["offload_optimizer"] = {"device": "cpu"}
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}
    return cfg


def _remove_hooks(engine) -> None:
    """The calls trl.models.utils.remove_hooks makes on a DeepSpeed engine."""
    offload = engine.optimizer.parameter_offload
    named = itertools.chain(offload.module.named_parameters(recurse=True), offload.module.ds_external_parameters())
    for _, param in named:
        param.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _add_hooks(engine) -> None:
    """The call trl.models.utils.add_hooks makes (the store keeps no trace to invalidate: no param_coordinator)."""
    offload = engine.optimizer.parameter_offload
    offload._register_deepspeed_module(offload.module)


def grpo_body(offload: bool) -> dict:
    rank = torch.distributed.get_rank()
    with zero.zero.Init(config_dict_or_path=_cfg(offload)):
        model = _tiny_llama()
    torch_adamw = None if offload else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    engine, opt, *_ = zero.initialize(model=model, optimizer=torch_adamw, config=_cfg(offload))
    out = {"optimizer": type(opt).__name__, "generated": [], "losses": []}
    for rnd in range(ROUNDS):
        engine.eval()
        with torch.no_grad(), zero.zero.GatheredParameters(engine.parameters()):
            _remove_hooks(engine)
            seq = _generate(engine.module, _prompt(rank, rnd), rnd)
            _add_hooks(engine)
        out["generated"].append(seq)
        engine.train()
        loss = engine(input_ids=seq, labels=seq).loss
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    out["released"] = all(p.numel() == 0 for p in model.parameters())
    with zero.zero.GatheredParameters(list(model.parameters())):
        out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _reference() -> dict:
    model = _tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    out = {"generated": [], "losses": []}
    for rnd in range(ROUNDS):
        model.eval()
        with torch.no_grad():
            seqs = [_generate(model, _prompt(rank, rnd), rnd) for rank in range(2)]
        out["generated"].append(seqs)
        model.train()
        losses = [model(input_ids=s, labels=s).loss for s in seqs]
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
        out["losses"].append([x.item() for x in losses])
    out["weights"] = {n: p.detach() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("offload", [False, True])
def test_generation_between_training_steps_as_trl_unwraps_equals_one_process(offload):
    ref = _reference()
    for rank, out in enumerate(run_ranks(grpo_body, 2, offload, timeout=240)):
        assert out["optimizer"] == ("CPUAdam" if offload else "AdamW")
        for rnd in range(ROUNDS):
            assert torch.equal(out["generated"][rnd], ref["generated"][rnd][rank]), rnd
            assert out["generated"][rnd].shape[1] == 3 + rnd + 2 + rnd  # the shape changes every round
            assert out["losses"][rnd] == pytest.approx(ref["losses"][rnd][rank], rel=1e-5, abs=1e-6)
        assert out["released"]
        for n, want in ref["weights"].items():
            torch.testing.assert_close(out["weights"][n], want, rtol=0, atol=2e-5, msg=n)
