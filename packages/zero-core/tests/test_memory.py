"""model_state_bytes equals the ZeRO paper's per-rank formula (arXiv 1910.02054, section 5), padding included.

fp32 training (param = compute = master dtype): stage 0 ``16Ψ``, stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``,
stage 3 ``16Ψ/N``: the master shard is this rank's range of the parameter buffer and the reduced gradient shard is
this rank's range of the gradient buffer, never a second copy. Stage-3 persistent parameters (at most
``stage3_param_persistence_threshold`` elements) are additionally held whole on every rank, by design.
"""

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


def _body(stage, policy_name, threshold=0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 13), nn.Linear(13, 7))  # 143 + 98 = 241 elements
    policy = POLICIES[policy_name]
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters()),
                     ZeroConfig(stage=stage, stage3_param_persistence_threshold=threshold), policy)  # fmt: skip
    for _ in range(2):  # two steps: nothing transient may stay behind
        rt.backward(rt.module(torch.ones(2, 10, dtype=policy.compute)).float().square().mean(), is_boundary=True)
        rt.step()
    return rt.model_state_bytes()


def expected(stage: int, policy: PrecisionPolicy, world: int) -> dict:
    """Our accounting of the paper's formula. psi: elements, padded to equal shards per bucket/unit."""
    size = lambda dt: torch.empty(0, dtype=dt).element_size()  # noqa: E731
    p, c, a, m = size(policy.param_dtype), size(policy.compute), size(policy.accum), 4
    fp32 = policy.param_dtype == policy.compute == torch.float32  # the master is a range of the param buffer
    if stage == 0:
        psi = 241
        return dict(params=psi * c, grads=psi * a, master=0 if fp32 else psi * m, optimizer=8 * psi)
    psi = 242 if stage < 3 else 144 + 98  # one bucket padded to 2 | one unit per Linear, each padded
    shard = psi // world
    if stage == 1:  # full local gradients; the reduced shard is this rank's range of them
        return dict(params=psi * c, grads=psi * a, master=0 if fp32 else shard * m, optimizer=8 * shard)
    if stage == 2:
        return dict(params=psi * c, grads=shard * a, master=0 if fp32 else shard * m, optimizer=8 * shard)
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
            paper = {0: 16 * 241, 1: 4 * 242 + 12 * 121, 2: 2 * 242 + 14 * 121, 3: 16 * 121}[stage]
            assert want["total"] == paper, stage
        if policy_name == "fp32":  # the fp32 formula of the ZeRO paper's figure 1 with K = 8 (Adam)
            fp32 = {0: 16 * 241, 1: 8 * 242 + 8 * 121, 2: 4 * 242 + 12 * 121, 3: 16 * 121}[stage]
            assert want["total"] == fp32, stage


@pytest.mark.parametrize("policy_name", ["fp32", "bf16-cpu"])
def test_stage3_persistent_params_held_whole(policy_name):
    """Threshold 100: the second Linear (98) and the first bias (13) form one persistent bucket of 111 elements
    (padded to 112) that stays gathered on every rank in the compute dtype, on top of 16Ψ/N (130 + 112 = 242)."""
    policy = POLICIES[policy_name]
    got = run_ranks(_body, 2, 3, policy_name, 100, timeout=60)
    c = torch.empty(0, dtype=policy.compute).element_size()
    want = expected(3, policy, 2)
    want["params"] += 112 * c  # the persistent bucket's full buffer (its shard is counted in 16Ψ/N already)
    want["total"] = sum(want.values())
    assert got[0] == want == got[1], (got[0], want)
