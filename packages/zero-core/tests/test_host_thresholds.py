"""glibc's mmap/trim thresholds as stage 3 sets them (``zero_core.materialize.HostThresholds``): a serving process
(or zero_init's build) pins them at 128 KiB so freed activations go back to the OS; once the process trains, the
thresholds zero pinned move to 32 MiB (heap reuse for a step's activations) and later pins are refused; a threshold
the user chose through the environment is never touched. (glibc hosts: CI's Linux.)"""

from __future__ import annotations

from zero_core.materialize import HOST_MMAP_THRESHOLD, TRAINING_MMAP_THRESHOLD, HostThresholds


def test_pin_then_training_moves_the_pin_and_refuses_later_pins(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    t = HostThresholds()
    assert t.pin() and t.value == HOST_MMAP_THRESHOLD
    assert t.for_training() and t.value == TRAINING_MMAP_THRESHOLD and t.training
    assert not t.pin() and t.value == TRAINING_MMAP_THRESHOLD  # a serving engine later in a training process


def test_training_without_a_pin_leaves_glibcs_dynamic_thresholds(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    t = HostThresholds()
    assert not t.for_training() and t.value is None and t.training


def test_a_threshold_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    t = HostThresholds()
    assert not t.pin() and t.value is None
    assert not t.for_training() and t.value is None
