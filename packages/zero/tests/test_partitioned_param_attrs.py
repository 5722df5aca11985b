"""What integrations read off a partitioned parameter (DeepSpeed's ``ds_*`` names: PEFT's parameter count, TRL's
``ds_status`` check), on tied and untied models built under ``zero.Init``, before ``initialize()``, after it
and after a step, on both of 2 gloo ranks, against the dense model."""

import pytest
import torch

import zero
from zero.as_deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from zero_comm.testing import run_ranks


class Tied(torch.nn.Module):
    """An embedding whose weight is also the output head's (tied names share one parameter)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.embed(ids))))


def _model(tied: bool) -> torch.nn.Module:
    torch.manual_seed(3)
    if tied:
        return Tied()
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _input(tied: bool, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(0, 10, (4, 3), generator=g) if tied else torch.rand(4, 7, generator=g)


CFG = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip


def _read(model: torch.nn.Module) -> dict:
    return {name: {"id": p.ds_id, "shape": p.ds_shape, "numel": p.ds_numel, "status": p.ds_status,
                   "part": p.ds_tensor.detach().clone(), "pnumel": p.partition_numel()}
            for name, p in model.named_parameters(remove_duplicate=False)}  # fmt: skip


def attrs_body(tied: bool) -> dict:
    rank = torch.distributed.get_rank()
    with zero.zero.Init(config_dict_or_path=CFG):
        model = _model(tied)
    out = {"built": _read(model)}
    engine, *_ = zero.initialize(model=model, config=CFG)
    out["init"] = _read(engine.module)
    inside = {}

    def look(module, args):  # inside forward, the running module's parameters are gathered
        inside.update({id(p): p.ds_status for p in module.parameters(recurse=False)})

    first = next(m for m in engine.module.modules() if list(m.parameters(recurse=False)))
    handle = first.register_forward_pre_hook(look)
    loss = engine(_input(tied, rank)).square().mean()
    handle.remove()
    out["inside"] = list(inside.values())
    engine.backward(loss)
    engine.step()
    out["stepped"] = _read(engine.module)
    with zero.zero.GatheredParameters(list(engine.module.parameters())):
        out["gathered"] = {n: (p.ds_status, p.detach().clone()) for n, p in engine.module.named_parameters()}
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_ds_attributes_describe_the_full_parameter_on_every_rank(tied):
    r0, r1 = run_ranks(attrs_body, 2, tied, timeout=120)
    dense = dict(_model(tied).named_parameters(remove_duplicate=False))
    for when in ("built", "init", "stepped"):
        a, b = r0[when], r1[when]
        assert set(a) == set(dense)
        ids = {n: v["id"] for n, v in a.items()}
        assert ids == {n: v["id"] for n, v in b.items()}, when  # equal across ranks
        for n, v in a.items():
            assert v["shape"] == dense[n].shape and isinstance(v["shape"], torch.Size)
            assert v["numel"] == dense[n].numel()
            assert v["status"] is ZeroParamStatus.NOT_AVAILABLE and b[n]["status"] is ZeroParamStatus.NOT_AVAILABLE
            assert v["pnumel"] == v["part"].numel() and b[n]["pnumel"] == b[n]["part"].numel()
            whole = torch.cat([v["part"], b[n]["part"]])
            assert whole.numel() >= v["numel"]  # both ranks' partitions cover the parameter (padding included)
            expect = dense[n] if when != "stepped" else r0["gathered"][n if n in r0["gathered"] else "embed.weight"][1]
            assert torch.equal(whole[: v["numel"]].view(v["shape"]), expect.detach()), (when, n)
        # one id per parameter object: tied names share it, other names differ
        objects = {}
        for n, p in dense.items():
            objects.setdefault(id(p), set()).add(ids[n])
        assert all(len(s) == 1 for s in objects.values())
        assert len({next(iter(s)) for s in objects.values()}) == len(objects)
    assert r0["inside"] and all(s is ZeroParamStatus.AVAILABLE for s in r0["inside"] + r1["inside"])
    assert all(s is ZeroParamStatus.AVAILABLE for s, _ in r0["gathered"].values())
    assert all(torch.equal(r0["gathered"][n][1], r1["gathered"][n][1]) for n in r0["gathered"])
    if tied:
        assert r0["init"]["embed.weight"]["id"] == r0["init"]["head.weight"]["id"]


def test_plain_parameters_carry_no_ds_names():
    p = torch.nn.Linear(2, 2).weight
    assert type(p) is torch.nn.Parameter and not hasattr(p, "ds_numel")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(cfg)


def peft_body() -> dict:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with zero.zero.Init(config_dict_or_path=CFG):
        base = _tiny_llama()
    model = get_peft_model(base, lora)
    before = model.get_nb_trainable_parameters()
    engine, *_ = zero.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                 config=CFG)  # fmt: skip
    after = engine.module.get_nb_trainable_parameters()
    return {"before": before, "after": after, "released": all(p.numel() == 0 for p in base.parameters()
                                                              if p.ds_numel > 0 and not p.requires_grad)}  # fmt: skip


def test_peft_counts_the_dense_number_of_parameters_at_stage3():
    from peft import LoraConfig, get_peft_model

    dense = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))  # fmt: skip
    expected = dense.get_nb_trainable_parameters()
    assert expected[1] > 20_000  # (trainable, all)
    for out in run_ranks(peft_body, 2, timeout=180):
        assert out["before"] == expected and out["after"] == expected
        assert out["released"]
