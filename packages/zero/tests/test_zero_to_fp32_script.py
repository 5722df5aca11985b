"""The ``zero_to_fp32.py`` that ``save_checkpoint`` puts beside every checkpoint (as DeepSpeed does) converts it
standalone with DeepSpeed's command line, and says what is missing when zero-core cannot be imported."""

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero
from zero_comm.testing import run_ranks


class Net(torch.nn.Module):
    """Two linear layers with a BatchNorm between them (float and integer buffers)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 24)
        self.bn = torch.nn.BatchNorm1d(24)
        self.fc2 = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _full_state(engine) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in engine.runtime.full_parameters().items()}
    state.update({k: v.detach().clone() for k, v in engine.module.named_buffers()})
    return state


def save_body(save_dir: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # fmt: skip
    engine, *_ = zero.initialize(model=Net(), config=cfg)
    states = {}
    for tag in ("t1", "t2"):  # a step, then a checkpoint: t2 (the latest) differs from t1
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * len(states) + rank))
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.save_checkpoint(save_dir, tag=tag)
        states[tag] = _full_state(engine)
    return states


def _convert(*args: str, blocked: bool = False) -> tuple[int, str]:
    """Run the copied script ``args[0]`` as ``python zero_to_fp32.py ...`` would, in this process (a subprocess
    costs seconds of imports); ``blocked``: as if zero-core were not installed. Returns (exit status, stderr)."""
    saved_argv = sys.argv
    saved_core = {k: m for k, m in sys.modules.items() if k == "zero_core" or k.startswith("zero_core.")}
    sys.argv = list(args)
    if blocked:
        sys.modules.update(dict.fromkeys(saved_core))  # import zero_core... now raises ModuleNotFoundError
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(args[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code
    finally:
        sys.argv = saved_argv
        sys.modules.update(saved_core)
    return status, err.getvalue()


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        expect = value.float() if value.is_floating_point() else value
        assert got[name].dtype == expect.dtype, name
        torch.testing.assert_close(got[name], expect, rtol=0, atol=0)


@pytest.mark.smoke
def test_zero_to_fp32_script_beside_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    states = run_ranks(save_body, 2, str(ckpt), timeout=120)[0]
    script = ckpt / "zero_to_fp32.py"
    assert script.is_file() and os.access(script, os.X_OK)
    assert sorted(os.listdir(ckpt)) == ["latest", "t1", "t2", "zero_to_fp32.py"]

    # DeepSpeed's default form, in a fresh interpreter: the latest tag, torch format, into a folder
    done = subprocess.run([sys.executable, str(script), str(ckpt), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    _assert_equal(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), states["t2"])

    # -t, --safe_serialization and a shard limit smaller than the model: several files and an index
    status, err = _convert(str(script), str(ckpt), str(tmp_path / "split"), "-t", "t1", "--safe_serialization",
                           "--max_shard_size", "1KB")  # fmt: skip
    assert status == 0, err
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for name in files:
        merged.update(load_file(str(tmp_path / "split" / name)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    _assert_equal(merged, states["t1"])

    # the older output_file form: one file, format from its suffix
    status, err = _convert(str(script), str(ckpt), str(tmp_path / "one" / "weights.safetensors"))
    assert status == 0, err
    assert sorted(os.listdir(tmp_path / "one")) == ["weights.safetensors"]
    _assert_equal(load_file(str(tmp_path / "one" / "weights.safetensors")), states["t2"])

    # without zero-core: a message saying what to install, status 1, nothing written
    status, err = _convert(str(script), str(ckpt), str(tmp_path / "none"), blocked=True)
    assert status == 1 and "needs the zero-core package" in err
    assert not (tmp_path / "none").exists()

    # a tag that is not there: named, status 1
    status, err = _convert(str(script), str(ckpt), str(tmp_path / "bad"), "-t", "t9")
    assert status == 1 and "t9" in err
