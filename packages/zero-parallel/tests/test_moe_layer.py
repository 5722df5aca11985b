"""DeepSpeed's MoE layer in one process: the same outputs, l_aux, expert counts and gradients as DeepSpeed 0.19.8's
layer on the same weights (top-1, top-2, top-3, with and without dropped tokens; fixtures/moe_deepspeed.pt), its
module layout, the optimizer-group helpers, and clear errors for bad settings."""

from pathlib import Path

import pytest
import torch

from zero_parallel.moe import (
    MoE,
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
)

FIXTURE = Path(__file__).parent / "fixtures" / "moe_deepspeed.pt"


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))


@pytest.mark.parametrize("case", range(8))
def test_moe_layer_equals_deepspeed_on_the_same_weights(case):
    want = torch.load(FIXTURE, weights_only=True)[case]
    layer = MoE(8, _expert(), num_experts=4, k=want["k"], capacity_factor=want["capacity_factor"],
                min_capacity=want["min_capacity"], drop_tokens=want["drop_tokens"], use_rts=False,
                top2_2nd_expert_sampling=False)  # fmt: skip
    layer.load_state_dict(want["state"])  # DeepSpeed's names load as they are
    x = want["x"].clone().requires_grad_()
    y, l_aux, counts = layer(x)
    (y.square().sum() + l_aux).backward()
    torch.testing.assert_close(y, want["y"], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(l_aux, want["l_aux"], atol=1e-6, rtol=1e-6)
    assert torch.equal(counts, want["exp_counts"])
    torch.testing.assert_close(x.grad, want["x_grad"], atol=1e-5, rtol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, want["grads"][name], atol=1e-5, rtol=1e-5, msg=name)


def test_dropped_tokens_give_zero_output_and_dropless_drops_none():
    torch.manual_seed(1)
    x = torch.randn(40, 8)
    tight = MoE(8, _expert(), num_experts=4, capacity_factor=0.25, min_capacity=0, use_rts=False)
    y, _, counts = tight(x)
    dropped = int((y.abs().sum(-1) == 0).sum())
    capacity = 3  # ceil(40 / 4 * 0.25)
    assert dropped == int(sum(max(int(c) - capacity, 0) for c in counts)) and dropped > 0
    dropless = MoE(8, _expert(), num_experts=4, drop_tokens=False)
    assert int((dropless(x)[0].abs().sum(-1) == 0).sum()) == 0


def test_layout_marks_and_residual_branch():
    layer = MoE(8, _expert(), num_experts=4, ep_size=2, use_residual=True)
    names = [n for n, _ in layer.named_parameters()]
    assert "deepspeed_moe.gate.wg.weight" in names and "deepspeed_moe.experts.deepspeed_experts.1.2.bias" in names
    assert "deepspeed_moe.experts.deepspeed_experts.2.0.weight" not in names  # 2 local experts of 4
    assert "coefficient.weight" in names and "mlp.0.weight" in names
    experts = list(layer.deepspeed_moe.experts.parameters())
    assert all(is_moe_param(p) and p.group_name == "ep_size_2" for p in experts)
    assert not is_moe_param(layer.deepspeed_moe.gate.wg.weight) and not is_moe_param(layer.mlp[0].weight)
    assert layer.num_local_experts == 2 and has_moe_layers(torch.nn.Sequential(layer)) == (True, 4)
    dense = MoE(8, _expert(), num_experts=2, use_residual=True)
    x = torch.randn(5, 8)
    y, _, _ = dense(x)
    coef = torch.softmax(dense.coefficient(x), dim=-1)
    want = dense.deepspeed_moe(x) * coef[:, :1] + dense.mlp(x) * coef[:, 1:]
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)


def test_optimizer_groups_put_experts_apart():
    layer = MoE(8, _expert(), num_experts=2)
    params = list(layer.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense", "lr": 0.1})
    assert [g["name"] for g in groups] == ["dense", "ep_size_1"] and groups[1]["moe"] and groups[1]["lr"] == 0.1
    assert groups[0]["params"] == [layer.deepspeed_moe.gate.wg.weight]
    assert groups[1]["params"] == list(layer.deepspeed_moe.experts.parameters())
    cut = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "d"}, max_group_size=200)
    sizes = [sum(p.numel() for p in g["params"]) for g in cut[1:]]
    assert sizes == [128 + 16, 128 + 8] * 2  # per expert: Linear(8, 16), Linear(16, 8)
    assert [is_moe_param_group(g) for g in configure_moe_param_groups(params)] == [False, True]
    with pytest.raises(KeyError, match="'name' key"):
        split_params_into_different_moe_groups_for_optimizer([{"params": params}])
    with pytest.raises(TypeError, match="tensors or dicts"):
        configure_moe_param_groups([1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 6, "ep_size": 4}, r"num_experts \(6\) must be divisible by ep_size \(4\)"),
        ({"num_experts": 4, "capacity_factor": 0.0, "min_capacity": 0}, "every token would be dropped"),
        ({"num_experts": 4, "eval_capacity_factor": 0.0, "min_capacity": 0}, "eval_capacity_factor=0"),
        ({"num_experts": 4, "capacity_factor": -1.0}, "capacity_factor must be a finite number >= 0"),
        ({"num_experts": 4, "min_capacity": -2}, "min_capacity must be a non-negative integer"),
        ({"num_experts": 4, "k": 5}, "k \\(experts per token\\) must be between 1 and num_experts=4"),
        ({"num_experts": 4, "noisy_gate_policy": "Gauss"}, "noisy_gate_policy must be one of"),
        ({"num_experts": 4, "enable_expert_tensor_parallelism": True}, "enable_expert_tensor_parallelism"),
    ],
)
def test_bad_settings_raise_naming_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoE(8, _expert(), **kwargs)


def test_capacity_zero_without_dropping_is_allowed_and_too_few_tokens_raise():
    y, _, _ = MoE(8, _expert(), num_experts=4, capacity_factor=0.0, min_capacity=0, drop_tokens=False)(
        torch.randn(6, 8)
    )
    assert y.shape == (6, 8) and int((y.abs().sum(-1) == 0).sum()) == 0
    with pytest.raises(ValueError, match="fewer than min_capacity=4"):
        MoE(8, _expert(), num_experts=4)(torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="set_deepspeed_parallelism"):
        MoE(8, _expert(), num_experts=4, ep_size=2)(torch.randn(6, 8))
