"""The GPU check script imports and runs here: without CUDA it says so and exits 0; with CUDA it runs a tiny
model through every mode. Its overlap measure is checked on known intervals."""

import importlib.util
from pathlib import Path

import torch

PATH = Path(__file__).resolve().parents[1] / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("zero_offload_gpu_check", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_overlap_fraction():
    f = _load().overlap_fraction
    assert f([], [(0, 1)]) is None
    assert f([(0, 2)], [(1, 3)]) == 0.5
    assert f([(0, 2), (4, 6)], [(0, 1), (0.5, 2), (10, 11)]) == 0.5  # overlapping kernels counted once
    assert f([(0, 1)], []) == 0.0


def test_gpu_check_runs(capsys):
    args = [] if not torch.cuda.is_available() else ["--layers", "1", "--hidden", "64", "--steps", "3"]
    assert _load().main(args) == 0
    out = capsys.readouterr().out
    assert ("no CUDA" in out) != torch.cuda.is_available()
