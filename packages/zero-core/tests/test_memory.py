"""model_state_bytes equals the ZeRO paper's per-rank formula (arXiv 1910.02054, section 5), padding included."""

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime

POLICIES = {
    "fp32": PrecisionPolicy(),
    "bf16-cpu": PrecisionPolicy.bf16(),  # bf16 storage/communication, fp32 compute and accumulation
    "paper": PrecisionPolicy(torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16),
}


def _body(stage, policy_name):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 13), nn.Linear(13, 7))  # 143 + 98 = 241 elements
    policy = POLICIES[policy_name]
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters()),
                     ZeroConfig(stage=stage, stage3_param_persistence_threshold=0), policy)  # fmt: skip
    rt.backward(rt.module(torch.ones(2, 10, dtype=policy.compute)).float().square().mean())
    rt.step()
    return rt.model_state_bytes()


def expected(stage: int, policy: PrecisionPolicy, world: int) -> dict:
    """Our accounting of the paper's formula. psi: elements, padded to equal shards per bucket/unit."""
    size = lambda dt: torch.empty(0, dtype=dt).element_size()  # noqa: E731
    p, c, a, m = size(policy.param_dtype), size(policy.compute), size(policy.accum), 4
    if stage == 0:
        psi = 241
        alias = policy.param_dtype == policy.compute == torch.float32
        return dict(params=psi * c, grads=psi * a, master=0 if alias else psi * m, optimizer=8 * psi)
    psi = 242 if stage < 3 else 144 + 98  # one bucket padded to 2 | one unit per Linear, each padded
    shard = psi // world
    if stage == 1:  # full local gradients + the reduced shard the optimizer reads
        return dict(params=psi * c, grads=psi * a + shard * a, master=shard * m, optimizer=8 * shard)
    if stage == 2:
        return dict(params=psi * c, grads=shard * a, master=shard * m, optimizer=8 * shard)
    alias = policy.param_dtype == torch.float32  # the stored fp32 shard is the master
    return dict(params=shard * p, grads=shard * a, master=0 if alias else shard * m, optimizer=8 * shard)


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_model_state_bytes_match_formula(policy_name):
    policy = POLICIES[policy_name]
    for stage in (0, 1, 2, 3):
        got = run_ranks(_body, 2, stage, policy_name, timeout=60)
        want = expected(stage, policy, 2)
        want["total"] = sum(want.values())
        assert got[0] == want == got[1], (stage, policy_name, got[0], want)
        if policy_name == "paper":  # (2 + 2 + K) psi with K = 12, partitioned per stage
            psi = want["params"] // 2 if stage < 3 else None
            paper = {0: 16 * 241, 1: 4 * 242 + 12 * 121, 2: 2 * 242 + 14 * 121, 3: 16 * 121}[stage]
            extra = 2 * 121 if stage == 1 else 0  # stage 1 also keeps the reduced gradient shard
            assert want["total"] == paper + extra, (stage, psi)
