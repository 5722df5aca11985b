"""A mostly frozen model (a trainable head over a frozen base, as LoRA fine-tuning has) given to ``initialize`` with
the config's ``optimizer`` section: the optimizer zero builds leaves the frozen base out, as DeepSpeed's ZeRO does
(no master copy, gradient buffer or optimizer state for it), trains like torch's AdamW over the head alone, and a
base unfrozen afterwards is a ValueError naming it on every rank instead of a weight that silently never moves. An
optimizer the user passes keeps every parameter it was given."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
from zero.optim.trainable import split_trainable
from zero_comm.testing import run_ranks

WORLD, STEPS, LR = 2, 3, 1e-2
CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}}}  # fmt: skip


class Tuned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.base = torch.nn.Linear(6, 9)
        self.head = torch.nn.Linear(9, 4)
        self.base.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.base(x)))


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(4 * WORLD, 6, generator=g), torch.randint(0, 4, (4 * WORLD,), generator=g)


def _reference() -> dict[str, torch.Tensor]:
    model = Tuned()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _groups_holding(engine) -> dict[str, int | None]:
    """Parameter name -> the optimizer param group of its flat group (None: the frozen flat group)."""
    return {s.name: g.group_index for g in engine.runtime.flat_groups for s in g.slots}


def _body():
    rank = dist.get_rank()
    out = {}
    for stage in (0, 1, 2, 3):
        engine, optimizer, *_ = zero.initialize(model=Tuned(), config={**CONFIG, "zero_optimization": {"stage": stage}})
        held = sum(p.numel() for pg in optimizer.param_groups for p in pg["params"])  # this rank's elements
        for step in range(STEPS):
            x, y = _batch(step)
            engine.backward(F.cross_entropy(engine(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]))
            engine.step()
        trained = {k: v.clone() for k, v in engine.runtime.full_parameters().items()}
        engine.module.base.requires_grad_(True)
        x, y = _batch(STEPS)
        try:
            engine.backward(F.cross_entropy(engine(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]))
            unfrozen = None
        except ValueError as exc:
            unfrozen = str(exc)
        out[stage] = {"groups": _groups_holding(engine), "held": held, "trained": trained, "unfrozen": unfrozen}
    passed, *_ = zero.initialize(model=(m := Tuned()), optimizer=torch.optim.AdamW(m.parameters(), lr=LR),
                                 config={**CONFIG, "optimizer": None, "zero_optimization": {"stage": 2}})  # fmt: skip
    frozen_model = Tuned().requires_grad_(False)
    _, all_frozen, *_ = zero.initialize(model=frozen_model, config={**CONFIG, "zero_optimization": {"stage": 1}})
    out["passed"] = _groups_holding(passed)
    out["all_frozen"] = sum(p.numel() for pg in all_frozen.param_groups for p in pg["params"])
    return out


def test_config_built_optimizer_leaves_the_frozen_base_out_trains_the_head_and_names_a_late_unfreeze():
    want = _reference()
    for rank, out in enumerate(run_ranks(_body, WORLD, timeout=120)):
        for stage in (0, 1, 2, 3):
            got = out[stage]
            label = f"stage {stage} rank {rank}"
            assert got["groups"]["base.weight"] is None and got["groups"]["base.bias"] is None, f"{label}: {got}"
            assert got["groups"]["head.weight"] == 0 and got["groups"]["head.bias"] == 0, f"{label}: {got}"
            # the head's 40 elements, partitioned over the ranks from stage 1 on (the base's 60 would double it)
            assert got["held"] == 40 // (WORLD if stage else 1), f"{label}: the optimizer holds {got['held']} elements"
            for name, value in want.items():
                torch.testing.assert_close(got["trained"][name], value, rtol=1e-6, atol=1e-7, msg=f"{label} {name}")
            assert got["unfrozen"] is not None and "'base.weight'" in got["unfrozen"], f"{label}: {got['unfrozen']}"
            assert "optimizer=" in got["unfrozen"], got["unfrozen"]  # says how to keep it trainable
        assert out["passed"]["base.weight"] == 0, f"rank {rank}: a passed optimizer's frozen parameter: {out}"
        # a model frozen whole keeps every parameter (100 elements) in its optimizer: it may be unfrozen later
        assert out["all_frozen"] >= 100 // WORLD, f"rank {rank}: {out['all_frozen']}"


def test_split_trainable_filters_param_groups_and_drops_emptied_ones():
    a, b, c = (torch.nn.Parameter(torch.ones(2)) for _ in range(3))
    b.requires_grad_(False)
    c.requires_grad_(False)
    kept, left_out = split_trainable([{"params": [a, b], "lr": 0.1}, {"params": [c], "weight_decay": 0.0}])
    assert len(kept) == 1 and kept[0]["lr"] == 0.1 and kept[0]["params"] == [a]
    assert left_out == [b, c]
    kept, left_out = split_trainable([b, a])
    assert kept == [a] and left_out == [b]
    kept, left_out = split_trainable([b, c])  # nothing trainable: kept whole
    assert kept == [b, c] and left_out == []
