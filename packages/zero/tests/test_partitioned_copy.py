"""``copy.deepcopy`` of a module whose parameters are partitioned (PEFT's ``modules_to_save`` copies the head of a
model built under ``zero.Init``): the copy has the full shape, starts equal to the original, trains at stage 3
like the single-process reference and saves full-size. In-place writes into a released parameter raise; inside
``GatheredParameters(modifier_rank=0)`` they land. 2 gloo ranks."""

import copy
import os

import torch

import zero
from zero_comm.testing import run_ranks

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
       "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
       "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                             "stage3_gather_16bit_weights_on_model_save": True}}  # fmt: skip


class WithHead(torch.nn.Module):
    """A body and a head; ``head_copy`` (added later, as PEFT does) replaces the head in forward when present."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        head = self.head_copy if hasattr(self, "head_copy") else self.head
        return head(torch.tanh(self.body(x)))


def _build() -> WithHead:
    torch.manual_seed(11)
    return WithHead()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.rand(2, 5, generator=torch.Generator().manual_seed(10 * step + rank))


def _prepare(model: WithHead) -> list[torch.nn.Parameter]:
    model.head_copy = copy.deepcopy(model.head)
    for p in (*model.head.parameters(), *model.body.parameters()):
        p.requires_grad_(False)
    return list(model.head_copy.parameters())


def copy_body(out_dir: str) -> dict:
    rank = torch.distributed.get_rank()
    with zero.zero.Init(config_dict_or_path=CFG):
        model = _build()
    trained = _prepare(model)
    out = {"copy_shapes": [tuple(p.ds_shape) for p in trained]}
    with zero.zero.GatheredParameters(list(model.parameters())):
        out["starts_equal"] = all(torch.equal(a, b) for a, b in zip(model.head.parameters(), trained))
        out["full_numels"] = [p.numel() for p in trained]
    engine, *_ = zero.initialize(model=model, model_parameters=trained, config=CFG)
    for step in range(2):
        engine.backward(engine(_batch(rank, step)).square().mean())
        engine.step()
    engine.save_16bit_model(out_dir, "model.safetensors")
    # a copy made after initialize (the parameters are held by the runtime and released): full-size too
    late = copy.deepcopy(model.head_copy)
    out["late"] = [p.detach().clone() for p in late.parameters()]
    return out


def _reference() -> dict[str, torch.Tensor]:
    model = _build()
    trained = _prepare(model)
    opt = torch.optim.AdamW(trained, lr=0.01, weight_decay=0.0)
    for step in range(2):
        opt.zero_grad()
        loss = sum(model(_batch(rank, step)).square().mean() for rank in range(2)) / 2
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_deepcopy_of_a_partitioned_head_trains_like_one_process_and_saves_full_size(tmp_path):
    from safetensors.torch import load_file

    ref = _reference()
    for out in run_ranks(copy_body, 2, str(tmp_path), timeout=120):
        assert out["copy_shapes"] == [(8, 8), (8,)] and out["full_numels"] == [64, 8]
        assert out["starts_equal"]
        torch.testing.assert_close(out["late"][0], ref["head_copy.weight"], rtol=0, atol=1e-6)
        torch.testing.assert_close(out["late"][1], ref["head_copy.bias"], rtol=0, atol=1e-6)
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(saved) == set(ref)
    for k, v in ref.items():
        assert saved[k].shape == v.shape, k
        torch.testing.assert_close(saved[k], v, rtol=0, atol=1e-6)
    assert not torch.equal(saved["head_copy.weight"], saved["head.weight"])  # trained; the frozen head is not


def writes_body() -> dict:
    from zero_core.partitioned_param import PartitionedWriteError

    with zero.zero.Init(config_dict_or_path=CFG):
        model = _build()
    errors = []

    def attempt(write) -> None:
        try:
            with torch.no_grad():
                write()
        except PartitionedWriteError as e:
            errors.append(str(e))

    attempt(lambda: torch.nn.init.zeros_(model.head.weight))  # partitioned at construction
    engine, *_ = zero.initialize(model=model, config=CFG)
    attempt(lambda: model.head.bias.fill_(3.0))  # held by the stage-3 runtime, released
    attempt(lambda: model.head.weight.mul_(0.0))
    with zero.zero.GatheredParameters([model.head.bias], modifier_rank=0):
        with torch.no_grad():
            model.head.bias.fill_(3.0)  # lands
    with zero.zero.GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"errors": errors, "values": values}


def test_writes_into_a_released_parameter_raise_and_inside_gathered_parameters_land():
    dense = dict(_build().named_parameters())
    for out in run_ranks(writes_body, 2, timeout=120):
        assert len(out["errors"]) == 3
        assert all("(8, 8)" in e or "(8,)" in e for e in out["errors"])
        assert all("GatheredParameters" in e for e in out["errors"])
        assert torch.equal(out["values"]["head.bias"], torch.full((8,), 3.0))
        for n in ("head.weight", "body.weight", "body.bias"):
            assert torch.equal(out["values"][n], dense[n].detach()), n  # the refused writes changed nothing
