"""The autotuner's memory model against zero_core's measured model-state bytes (within 10%) at every stage, and
its budget arithmetic: the largest micro-batch that fits, never one beyond the budget."""

import pytest
import torch
from torch import nn

from zero.autotune.memory import Dtypes, MemoryModel, ModelInfo, model_state_prediction, persistent_elements
from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime

POLICIES = {"fp32": PrecisionPolicy(), "bf16": PrecisionPolicy.bf16()}


def _model() -> nn.Module:
    torch.manual_seed(0)  # 64*257+257 + 257*33+33 = 25,218 elements: no world size divides every bucket evenly
    return nn.Sequential(nn.Linear(64, 257), nn.GELU(), nn.Linear(257, 33))


def _measure(stage: int, policy_name: str, threshold: int, bucket: int) -> dict:
    model = _model()
    numels = [p.numel() for p in model.parameters()]
    policy = POLICIES[policy_name]
    cfg = ZeroConfig(stage=stage, stage3_param_persistence_threshold=threshold, reduce_bucket_size=bucket)
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters()), cfg, policy)
    for _ in range(2):
        x = torch.randn(4, 64, dtype=policy.compute)
        rt.backward(rt.module(x).float().square().mean(), is_boundary=True)
        rt.step()
    return {"measured": rt.model_state_bytes(), "numels": numels}


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("threshold,bucket", [(0, 10_000), (10_000, 500_000_000)])
def test_prediction_within_10_percent_of_measured_model_states(policy_name, threshold, bucket):
    policy = POLICIES[policy_name]
    for stage in (0, 1, 2, 3):
        got = run_ranks(_measure, 2, stage, policy_name, threshold, bucket, timeout=90)[0]
        numels = got["numels"]
        persistent = persistent_elements(numels, threshold)
        buckets = -(-sum(numels) // bucket)
        want = model_state_prediction(stage, sum(numels), 2, Dtypes.of(policy), 8.0, persistent, buckets)
        measured = got["measured"]["total"]
        assert abs(want["total"] - measured) <= 0.10 * measured, (stage, policy_name, threshold, bucket, want,
                                                                  got["measured"])  # fmt: skip


def test_prediction_is_the_paper_formula_in_fp32():
    psi, n = 1000, 4
    fp32 = Dtypes()
    got = {s: model_state_prediction(s, psi, n, fp32)["total"] for s in range(4)}
    assert got == {0: 16 * psi, 1: 8 * psi + 8 * psi // n, 2: 4 * psi + 12 * psi // n, 3: 16 * psi // n}
    with pytest.raises(ValueError, match="stage must be 0-3"):
        model_state_prediction(4, psi, n, fp32)


def test_largest_micro_batch_fits_the_budget():
    info = ModelInfo(num_params=1_000_000, param_numels=(1_000_000,), activation_bytes_per_sample=1e6,
                     optimizer_bytes_per_element=8.0, overhead_bytes=10_000_000)  # fmt: skip
    budget = 30_000_000
    mm = MemoryModel(info, world=2, dtypes=Dtypes(), budget=budget)
    # stage 0: 16 MB states + 10 MB overhead leave 4 samples; stage 3: 8 MB + 10 MB leave 12
    assert mm.largest_micro_batch(0, 1, 1024) == 4
    assert mm.largest_micro_batch(3, 1, 1024) == 12
    assert mm.predict(3, 12).total <= budget < mm.predict(3, 13).total
    assert mm.largest_micro_batch(3, 1, 8) == 8  # capped by max_train_micro_batch_size_per_gpu
    small = MemoryModel(info, world=2, dtypes=Dtypes(), budget=20_000_000)
    assert small.largest_micro_batch(0, 1, 1024) is None  # 16 MB + 10 MB + 1 MB > 20 MB: nothing fits
