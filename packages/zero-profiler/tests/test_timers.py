"""Timers: per-step sums of repeated intervals, mean/median breakdown, steps_per_print, misuse errors."""

import time

import pytest
import torch

from zero_profiler import Timers


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_timers_sum_intervals_within_a_step_and_record_each_step():
    timers = Timers(device="cpu")
    assert not timers.uses_cuda_events
    measured = []
    for _ in range(3):
        with timers("forward"):
            _busy(0.002)
        for _ in range(2):  # a collective waited twice in one step
            timers("allgather_wait").start()
            _busy(0.001)
            timers("allgather_wait").stop()
        measured.append(timers.end_step())
    for seconds in measured:
        assert set(seconds) == {"forward", "allgather_wait"}
        assert seconds["forward"] >= 0.002 and seconds["allgather_wait"] >= 0.002
    stats = {s.name: s for s in timers.breakdown()}
    fwd = [m["forward"] * 1e3 for m in measured]
    assert stats["forward"].steps == 3
    assert stats["forward"].mean_ms == pytest.approx(sum(fwd) / 3)
    assert stats["forward"].median_ms == pytest.approx(sorted(fwd)[1])
    assert stats["forward"].max_ms == pytest.approx(max(fwd))
    assert stats["forward"].total_ms == pytest.approx(sum(fwd))


def test_timer_absent_from_a_step_it_did_not_run_in():
    timers = Timers(device="cpu")
    with timers.time("step"):
        pass
    assert set(timers.end_step()) == {"step"}
    assert timers.end_step() == {}
    assert [s.steps for s in timers.breakdown()] == [1]


def test_maybe_report_every_steps_per_print_then_resets():
    timers = Timers(device="cpu")
    printed = []
    outputs = []
    for step in range(1, 7):
        with timers("forward"):
            pass
        timers.end_step()
        outputs.append(timers.maybe_report(step, steps_per_print=3, printer=printed.append))
    assert [o is not None for o in outputs] == [False, False, True, False, False, True]
    assert printed == [outputs[2], outputs[5]]
    assert outputs[2].startswith("step 3: time per step over the last 3 step(s):")
    assert "forward: mean" in outputs[2] and "median" in outputs[2]
    assert timers.breakdown() == []  # reset after printing
    with pytest.raises(ValueError, match="steps_per_print must be >= 1, got 0"):
        timers.maybe_report(1, 0)


def test_misuse_is_reported_with_the_timer_name():
    timers = Timers(device="cpu")
    with pytest.raises(RuntimeError, match="'backward' stopped without start"):
        timers("backward").stop()
    timers("backward").start()
    with pytest.raises(RuntimeError, match="'backward' started twice"):
        timers("backward").start()
    with pytest.raises(RuntimeError, match=r"still running at end_step: \['backward'\]"):
        timers.end_step()


def test_cuda_events_when_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    timers = Timers(device="cuda")
    assert timers.uses_cuda_events
    a = torch.randn(2048, 2048, device="cuda")
    with timers("forward"):
        for _ in range(10):
            a = a @ a / 2048
    seconds = timers.end_step()
    assert seconds["forward"] > 0
