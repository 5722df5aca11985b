"""transformers' Trainer and Accelerate running on zero through ``zero run --as-deepspeed`` (2 CPU ranks, gloo).

Each job is a real launch (torchrun through ``zero run``), as users run them; the reference is the same job under
the libraries' own CPU DDP, run first in the same launch (one process start-up for several runs, see
jobs/job_modes.py). fp32 throughout: the losses must agree to 1e-5 relative, a resumed run bitwise.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_launch import JOBS, zero_run_modes  # noqa: E402

# The Trainer fixture makes two launches (five runs) inside the first test's time: above the suite's 600 s per test.
pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Every Trainer run of this file: the DDP reference, ZeRO-2, ZeRO-3 (checkpoint at step 10, save_model) and a
    forward-only ZeRO-3 evaluate() in one launch, then the resume from ZeRO-3's checkpoint in a fresh one."""
    out = tmp_path_factory.mktemp("trainer")
    runs = zero_run_modes("hf_trainer_job.py", out, ("ddp", "zero2", "zero3", "eval"))
    runs.update(zero_run_modes("hf_trainer_job.py", out, ("resume",)))
    return out, runs


@pytest.mark.parametrize("mode", ["zero3", "zero2"])
def test_trainer_with_auto_values_equals_ddp(trainer_runs, mode):
    _, runs = trainer_runs
    ddp, zero = runs["ddp"]["losses"], runs[mode]["losses"]
    assert sorted(ddp, key=int) == [str(i) for i in range(1, 21)] and set(zero) == set(ddp)
    for step in ddp:
        assert zero[step] == pytest.approx(ddp[step], rel=1e-5), step


def test_trainer_resume_continues_the_loss_curve_bitwise(trainer_runs):
    """The resumed run also builds its model with from_pretrained under ZeRO-3 and trains with gradient
    checkpointing: neither may change a bit of the loss curve."""
    _, runs = trainer_runs
    resumed, full = runs["resume"]["losses"], runs["zero3"]["losses"]
    assert sorted(resumed, key=int) == [str(i) for i in range(11, 21)]
    assert all(resumed[s] == full[s] for s in resumed)


def test_from_pretrained_under_zero3_loads_partitioned(trainer_runs):
    from transformers import LlamaForCausalLM

    out, runs = trainer_runs
    assert runs["resume"]["partitioned_at_load"]  # built under zero.Init: every rank holds shards only
    saved = LlamaForCausalLM.from_pretrained(out / "saved")
    sums = runs["resume"]["loaded_sums"]
    assert set(sums) == {n for n, _ in saved.named_parameters()}
    assert all(sums[n] == p.double().sum().item() for n, p in saved.named_parameters())


def test_trainer_save_model_loads_with_from_pretrained(trainer_runs):
    from transformers import LlamaForCausalLM

    from zero.checkpoint_tools.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out, _ = trainer_runs
    saved = LlamaForCausalLM.from_pretrained(out / "saved")
    ddp_final = LlamaForCausalLM.from_pretrained(out / "ddp" / "checkpoint-20")
    sharded = get_fp32_state_dict_from_zero_checkpoint(out / "zero3" / "checkpoint-20")
    for name, p in saved.state_dict().items():
        assert torch.equal(p, sharded[name]), name  # save_model == the engine's own checkpoint of step 20
        assert torch.allclose(p, ddp_final.state_dict()[name], rtol=1e-4, atol=1e-6), name


def test_trainer_save_model_without_gathering_leaves_a_checkpoint_for_zero_to_fp32(trainer_runs, tmp_path):
    """stage3_gather_16bit_weights_on_model_save false: transformers' save_model gets no weights (Accelerate raises
    on the engine's answer) and saves a checkpoint instead; its zero_to_fp32.py gives save_model's weights."""
    from safetensors.torch import load_file

    out, _ = trainer_runs
    folder = out / "saved_without_gather"
    assert not (folder / "model.safetensors").exists() and not (folder / "pytorch_model.bin").exists()
    assert (folder / "latest").read_text().strip() == "global_step20"
    done = subprocess.run([sys.executable, str(folder / "zero_to_fp32.py"), str(folder), str(tmp_path / "fp32"),
                           "--safe_serialization"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    converted = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    gathered = load_file(str(out / "saved" / "model.safetensors"))
    assert set(converted) == set(gathered)
    for name, value in gathered.items():
        assert torch.equal(converted[name], value), name


def test_accelerate_zero2_equals_its_ddp_run(tmp_path):
    runs = zero_run_modes("hf_accelerate_job.py", tmp_path, ("ddp", "zero2"))
    ddp, z2 = runs["ddp"], runs["zero2"]
    assert z2["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    assert set(z2["params"]) == set(ddp["params"])
    for name, values in ddp["params"].items():
        assert torch.allclose(torch.tensor(z2["params"][name]), torch.tensor(values), rtol=1e-5, atol=1e-6), name
    assert (tmp_path / "zero2-state" / "latest").is_file()  # save_state wrote the engine's checkpoint
    from zero.checkpoint_tools.to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "zero2-state")
    for name, values in z2["params"].items():
        assert torch.allclose(state[name].reshape(-1), torch.tensor(values), rtol=0, atol=0), name


def test_evaluate_without_training_at_zero3_equals_the_unsharded_eval_loss(trainer_runs):
    """transformers removes the optimizer section and initializes a forward-only engine; the eval loss is the
    mean of the per-batch losses, each batch repeated per sample (the Trainer's gather), in that order."""
    import numpy as np

    spec = importlib.util.spec_from_file_location("hf_trainer_job", JOBS / "hf_trainer_job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    out = trainer_runs[1]["eval"]
    assert out["optimizer"] and out["partitioned"]
    net, data = job.model().eval(), job.EvalTokens()
    losses = []
    with torch.no_grad():
        for start in range(0, len(data), 2):
            batch = [data[i] for i in range(start, start + 2)]
            ids = torch.stack([b["input_ids"] for b in batch])
            losses += [net(input_ids=ids, labels=ids).loss.item()] * 2
    assert out["eval_loss"] == float(np.mean(np.array(losses, dtype=np.float32)))
