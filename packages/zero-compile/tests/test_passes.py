"""The pass machinery: contracts checked before any graph is touched, the schedule by step, the ZeRO lint, and
``debug_log`` dumps of every pass's graph (one gloo rank)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from zero_comm.testing import run_ranks
from zero_compile import PREFETCH, SELECTIVE_UNSHARD, ZERO1, ZERO3, CompiledZero, Pass, PassError, ops
from zero_compile.passes import check_contracts, passes_for_step
from zero_compile.passes.base import lint_zero
from zero_compile.testing import LocalShards


def test_requires_and_conflicts_are_checked_in_order():
    with pytest.raises(PassError, match="'prefetch' requires \\['gather'\\]"):
        check_contracts([PREFETCH], "forward")
    with pytest.raises(PassError, match="'zero1' conflicts with \\['gather'\\] provided by pass 'zero3'"):
        check_contracts([ZERO3, ZERO1], "backward")
    assert [p.name for p in check_contracts([ZERO3, SELECTIVE_UNSHARD, PREFETCH], "forward")] == [
        "zero3", "selective_unshard", "prefetch"]  # fmt: skip
    assert check_contracts([ZERO1], "forward") == []  # ZeRO-1 leaves the forward alone


def test_schedule_picks_the_last_entry_started():
    a, b = Pass("a", lambda gm, ctx: gm), Pass("b", lambda gm, ctx: gm)
    schedule = [(0, [a]), (3, [a, b])]
    assert [p.name for p in passes_for_step(schedule, 0)] == ["a"]
    assert [p.name for p in passes_for_step(schedule, 2)] == ["a"]
    assert [p.name for p in passes_for_step(schedule, 3)] == ["a", "b"]
    assert passes_for_step([(1, [a])], 0) == []


def _graph(release_before_reader: bool) -> fx.Graph:
    g = fx.Graph()
    p = g.placeholder("p")
    g.call_function(ops.START, (1, [0], [p]))
    w = g.call_function(ops.WAIT, (1, 0, torch.float32, 18, p))
    if release_before_reader:
        g.call_function(ops.RELEASE, (1, 0, w, p))
    y = g.call_function(torch.ops.aten.mul.Tensor, (w, 2))
    if not release_before_reader:
        g.call_function(ops.RELEASE, (1, 0, w, p))
    g.output(y)
    return g


def test_lint_names_a_release_before_its_reader_and_unwaited_starts():
    lint_zero(_graph(False))
    with pytest.raises(PassError, match="released before its reader mul"):
        lint_zero(_graph(True))
    g = fx.Graph()
    p = g.placeholder("p")
    g.call_function(ops.START, (1, [3], [p]))
    g.output(None)
    with pytest.raises(PassError, match="unit 3: all-gather started but never waited"):
        lint_zero(g)


def _debug_dump(folder: str):
    torch._dynamo.reset()  # warm test workers are reused across tests
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    src = LocalShards(model, dist.group.WORLD)
    cz = CompiledZero(model, src, dist.group.WORLD, stage=3, warmup_steps=1, debug_dir=folder)
    for _ in range(2):
        cz(torch.randn(3, 4)).sum().backward()
        cz.after_backward()
        cz.after_step()
    cz.close()
    return sorted(os.listdir(folder))


def test_debug_log_dumps_each_pass_graph():
    with tempfile.TemporaryDirectory() as folder:
        names = run_ranks(_debug_dump, 1, folder, timeout=240)[0]
        for kind in ("forward", "backward"):
            assert f"graph0_{kind}_step0_00_captured.py" in names
            assert f"graph0_{kind}_step0_01_zero3.py" in names
            assert f"graph0_{kind}_step1_04_prefetch.py" in names
        with open(os.path.join(folder, "graph0_forward_step0_01_zero3.py")) as f:
            text = f.read()
        assert text.count("zero_compile.all_gather_wait") == 2 and text.count("zero_compile.release") == 2
