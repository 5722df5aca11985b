"""The MoE layer with experts spread over ranks equals one process holding every expert: on 4 gloo ranks with
ep_size 2 (two ranks hold each expert: expert-data parallelism) and 4, each rank's output equals the one-process
layer's on the same tokens, and the gradients equal the one-process gradients of the summed rank losses (the gate's
summed over all ranks, each expert's over its expert-data-parallel group); top-1 and top-2, dropless and with a
capacity large enough to drop nothing; experts that receive no token on a step; the groups' ranks; errors raised
on every rank."""

import torch
import torch.distributed as dist

from zero_comm.testing import run_ranks
from zero_parallel.moe import EXPERT_GROUPS, MoE
from zero_parallel.moe import groups as ds_groups

WORLD, E, M, T = 4, 4, 6, 5  # ranks, experts, hidden size, tokens per rank


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(M, 10), torch.nn.GELU(), torch.nn.Linear(10, M))


def _pair(ep: int, k: int, drop: bool, seed: int):
    """(one-process layer with every expert, this rank's layer holding E / ep of them, same weights)."""
    torch.manual_seed(seed)
    kw = {"k": k, "drop_tokens": drop, "capacity_factor": 4.0, "min_capacity": 0, "top2_2nd_expert_sampling": False}
    ref = MoE(M, _expert(), num_experts=E, **kw)
    with torch.no_grad():
        for e in ref.deepspeed_moe.experts.deepspeed_experts:
            for p in e.parameters():
                p.add_(torch.randn_like(p) * 0.3)  # experts differ
    layer = MoE(M, _expert(), num_experts=E, ep_size=ep, **kw)
    layer.set_deepspeed_parallelism()
    first = dist.get_rank(layer.deepspeed_moe.ep_group) * (E // ep)
    state = {"deepspeed_moe.gate.wg.weight": ref.deepspeed_moe.gate.wg.weight}
    for i in range(E // ep):
        for n, t in ref.deepspeed_moe.experts.deepspeed_experts[first + i].state_dict().items():
            state[f"deepspeed_moe.experts.deepspeed_experts.{i}.{n}"] = t
    layer.load_state_dict(state)
    return ref, layer, first


def _excess(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How far ``got`` is beyond fp32 1e-6 absolute plus 1e-6 relative of ``want`` (<= 1e-6 when within)."""
    return ((got - want).abs() - 1e-6 * want.abs()).max()


def _compare(ep: int, k: int, drop: bool, seed: int, one_expert: bool = False) -> dict:
    ref, layer, first = _pair(ep, k, drop, seed)
    x = torch.randn(WORLD, T, M)
    if one_expert:  # every token's logits favour expert 0: experts 1-3 receive nothing
        x[..., 0] = 3.0
        with torch.no_grad():
            for w in (ref.deepspeed_moe.gate.wg.weight, layer.deepspeed_moe.gate.wg.weight):
                w[:, 0] = torch.tensor([2.0, -2.0, -2.0, -2.0])
    rank = dist.get_rank()
    y, l_aux, counts = layer(x[rank])
    (y.square().mean() + l_aux).backward()
    whole, _, _ = ref(x.reshape(-1, M))  # the global batch in one forward
    ref_loss = sum(out.square().mean() + aux for out, aux, _ in (ref(x[r]) for r in range(WORLD)))
    ref_loss.backward()
    gate = layer.deepspeed_moe.gate.wg.weight.grad.clone()
    dist.all_reduce(gate)
    edp = ds_groups._get_expert_data_parallel_group(layer.expert_group_name)
    diffs = [_excess(gate, ref.deepspeed_moe.gate.wg.weight.grad)]
    for i, e in enumerate(layer.deepspeed_moe.experts.deepspeed_experts):
        for p, q in zip(e.parameters(), ref.deepspeed_moe.experts.deepspeed_experts[first + i].parameters()):
            g = p.grad.clone()
            dist.all_reduce(g, group=edp)
            diffs.append(_excess(g, q.grad))
    return {
        "y": _excess(y, whole.reshape(WORLD, T, M)[rank]).item(),
        "grads": max(d.item() for d in diffs),
        "counts": counts.tolist(),
        "idle_expert_grad": sum(p.grad.abs().sum().item() for p in layer.deepspeed_moe.experts.parameters())
        if one_expert and first > 0
        else 0.0,
    }


def _errors() -> dict:
    out = {}
    try:
        MoE(M, _expert(), num_experts=6, ep_size=4)
    except ValueError as exc:
        out["divisible"] = str(exc)
    try:
        MoE(M, _expert(), num_experts=3, ep_size=3).set_deepspeed_parallelism()
    except ValueError as exc:
        out["world"] = str(exc)
    return out


def _body() -> dict:
    out = {
        "ep2_top1_dropless": _compare(2, 1, False, 3),
        "ep2_top2_capacity": _compare(2, 2, True, 4),
        "ep4_top2_dropless": _compare(4, 2, False, 5),
        "ep4_top1_capacity": _compare(4, 1, True, 6),
        "ep2_idle_experts": _compare(2, 1, False, 7, one_expert=True),
        "errors": _errors(),
        "ep2_ranks": (
            ds_groups._get_expert_parallel_group_ranks("ep_size_2"),
            ds_groups._get_expert_data_parallel_group_ranks("ep_size_2"),
        ),  # fmt: skip
        "max_size": ds_groups._get_max_expert_size(),
    }
    EXPERT_GROUPS.clear()
    ds_groups._create_expert_and_data_parallel(2, use_data_before_expert_parallel_=True)
    out["ep2_d_before_e"] = (ds_groups._get_expert_parallel_group_ranks("ep_size_2"),
                             ds_groups._get_expert_data_parallel_group_ranks("ep_size_2"))  # fmt: skip
    return out


def test_expert_parallel_layer_equals_one_process_on_four_ranks():
    results = run_ranks(_body, WORLD)
    for rank, res in enumerate(results):  # every value within fp32 1e-6 (absolute and relative)
        for name in ("ep2_top1_dropless", "ep2_top2_capacity", "ep4_top2_dropless", "ep4_top1_capacity"):
            assert res[name]["y"] <= 1e-6 and res[name]["grads"] <= 1e-6, (rank, name, res[name])
        idle = res["ep2_idle_experts"]
        assert idle["y"] <= 1e-6 and idle["grads"] <= 1e-6 and idle["counts"] == [T, 0, 0, 0], idle
        assert idle["idle_expert_grad"] == 0.0  # ranks holding experts 2-3 got no token, and no gradient
        assert "num_experts (6) must be divisible by ep_size (4)" in res["errors"]["divisible"]
        assert "ep_size=3 must be a positive integer dividing the world size 4" in res["errors"]["world"]
        assert res["max_size"] == 4
        ep, edp = res["ep2_ranks"]
        assert ep == [rank // 2 * 2, rank // 2 * 2 + 1] and edp == [rank % 2, rank % 2 + 2]
        ep, edp = res["ep2_d_before_e"]
        assert ep == [rank % 2, rank % 2 + 2] and edp == [rank // 2 * 2, rank // 2 * 2 + 1]
