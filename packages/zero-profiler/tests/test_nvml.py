"""nvml_stats never breaks: without the package, without a driver, or with a GPU."""

import sys

import torch

from zero_profiler import nvml_stats


def test_without_nvidia_ml_py_the_result_says_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    r = nvml_stats()
    assert not r.available and r.gpus == ()
    assert r.reason.startswith("no NVIDIA GPU: nvidia-ml-py is not installed")
    assert r.format() == r.reason
    assert r.to_dict()["available"] is False


def test_with_the_package_but_no_driver_or_with_a_gpu():
    r = nvml_stats()
    if torch.cuda.is_available():
        assert r.available and len(r.gpus) >= 1
        g = r.gpus[0]
        assert g.memory_total and g.memory_total > 0 and 0 <= g.utilization_gpu_pct <= 100
        assert f"GPU 0 {g.name}" in r.format()
    else:
        assert not r.available and r.reason.startswith("no NVIDIA GPU")
