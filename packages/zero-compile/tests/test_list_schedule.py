"""The memory-aware list scheduler: on a model that reads one unit again after gathering another, it lowers the peak
live bytes the profiling interpreter measures (forward with autograd and without), stays within a budget the
original order exceeds, keeps the collectives in their original order (so every rank issues the same sequence) and
leaves gradients bitwise unchanged (one gloo rank)."""

from __future__ import annotations

import os
import re
import tempfile

import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks
from zero_compile import CompiledZero
from zero_compile.testing import LocalShards


class Revisit(torch.nn.Module):
    """``a`` is read again after ``b`` is used: in Python (and AOTAutograd) order both units are gathered at once."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x):
        y = self.a(x)
        z = self.b(x)
        return self.a(torch.relu(y)).sum() + z.sum()


def _run(schedule: bool, grad: bool, budget: int | None = None, folder: str | None = None):
    torch._dynamo.reset()  # warm test workers are reused across tests
    torch.manual_seed(0)
    model = Revisit()
    src = LocalShards(model, dist.group.WORLD)
    cz = CompiledZero(model, src, dist.group.WORLD, stage=3, warmup_steps=0, measure=True, list_schedule=schedule,
                      schedule_budget_bytes=budget, debug_dir=folder)  # fmt: skip
    x = torch.randn(4, 64)
    with torch.set_grad_enabled(grad):
        loss = cz(x)
    if grad:
        loss.backward()
        cz.after_backward()
    grads = {k: v.clone() for k, v in src.full_grads().items()} if grad else {}
    peaks = [p.peak_bytes for p in cz.store.profiles]  # forward first, then backward
    notes = [n.get("list_schedule") for n in cz.notes]
    cz.close()
    return float(loss), peaks, notes, grads


_COLLECTIVE = re.compile(r"zero_compile\.(all_gather_start|all_gather_wait|reduce_grads)\.default\(\d+, (\[?\d+)")


def _collectives(folder: str, name: str) -> list[str]:
    with open(os.path.join(folder, name)) as f:
        return _COLLECTIVE.findall(f.read())


def _training():
    with tempfile.TemporaryDirectory() as folder:
        plain, ordered = _run(False, True), _run(True, True, folder=folder)
        names = sorted(os.listdir(folder))
        order = {n: _collectives(folder, n) for n in names if "_01_zero3" in n or "_02_list_schedule" in n}
    return plain, ordered, order


def test_scheduler_lowers_the_measured_peak_and_keeps_order_and_gradients():
    plain, ordered, order = run_ranks(_training, 1, timeout=240)[0]
    assert ordered[0] == plain[0]
    for k, g in plain[3].items():
        assert torch.equal(ordered[3][k], g), k
    # forward: the second use of `a` and its release move before `b` is gathered
    assert ordered[1][0] < plain[1][0]
    assert all(o <= p for o, p in zip(ordered[1], plain[1]))
    fwd = ordered[2][0]
    assert fwd["reordered"] and fwd["peak_after"] == ordered[1][0]  # the model predicts what the interpreter measures
    for kind in ("forward", "backward"):
        before, after = (order[f"graph0_{kind}_step0_{s}.py"] for s in ("01_zero3", "02_list_schedule"))
        assert before and after == before  # collectives keep their relative order


def _inference(budget):
    return _run(False, False), _run(True, False, budget)


def test_scheduler_keeps_an_inference_graph_within_a_budget_the_original_order_exceeds():
    (_, plain, _, _), (_, low, _, _) = run_ranks(_inference, 1, None, timeout=240)[0]
    assert low[0] < plain[0]
    budget = (low[0] + plain[0]) // 2
    (loss_p, plain, _, _), (loss_b, within, notes, _) = run_ranks(_inference, 1, budget, timeout=240)[0]
    assert plain[0] > budget >= within[0] and loss_b == loss_p
    assert notes[0]["budget"] == budget and notes[0]["peak_after"] <= budget
