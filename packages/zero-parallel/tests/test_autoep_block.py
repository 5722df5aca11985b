"""AutoEP's expert-parallel block against the transformers Mixtral MoE block it replaces: in one process
(autoep_size 1) and on 2 gloo ranks (autoep_size 2, each rank half the experts, a different token count per rank),
every rank's output and its input's gradient equal the original block's on that rank's tokens (fp32, 1e-6), and
the local experts' gradients equal the original's rows summed over both ranks' tokens. Folded over a
tensor-parallel group of the same 2 ranks (both given the same 5 tokens, split 3 + 2), each rank's output, input
gradient and router gradient equal the original block's, and its experts' gradients the original's rows."""

import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from zero_comm.testing import run_ranks
from zero_parallel.moe import AUTOEP_PRESETS, ExpertParallelBlock, find_moe_blocks, replace_moe_blocks

H, E = 8, 4


def _block() -> torch.nn.Module:
    torch.manual_seed(3)
    cfg = MixtralConfig(hidden_size=H, intermediate_size=6, num_local_experts=E, num_experts_per_tok=2,
                        experts_implementation="eager")  # fmt: skip
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


class _Holder(torch.nn.Module):
    """A model with one MoE block at Mixtral's path ``model.layers.0.mlp``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = _block()


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(1, 5 + 3 * rank, H, generator=torch.Generator().manual_seed(rank))  # 5 and 8 tokens


def _loss(out: torch.Tensor, rank: int) -> torch.Tensor:
    """A fixed random projection of the output: a linear loss (well-conditioned gradients)."""
    return (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(50 + rank))).sum()


def _run(ep: int, folded: bool = False) -> dict:
    """``folded``: the block folded over a tensor-parallel group of every rank, each given rank 0's tokens."""
    rank = torch.distributed.get_rank() if ep > 1 else 0
    holder = _Holder()
    specs = find_moe_blocks(holder, AUTOEP_PRESETS["mixtral"], "the mixtral preset")
    replace_moe_blocks(holder, specs, ep, rank, torch.distributed.group.WORLD if folded else None)
    block = holder.model.layers[0].mlp
    assert isinstance(block, ExpertParallelBlock)
    if ep > 1:
        block.set_deepspeed_parallelism()
    data_rank = 0 if folded else rank
    x = _tokens(data_rank).requires_grad_()
    out = block(x)
    _loss(out, data_rank).backward()
    return {"out": out.detach(), "x_grad": x.grad, "gate_up": block.experts.gate_up_proj.grad,
            "down": block.experts.down_proj.grad, "router": block.gate.weight.grad}  # fmt: skip


def _unfolded_and_folded() -> tuple:
    return _run(2), _run(2, folded=True)


def _reference(world: int) -> list:
    block = _block()
    outs = []
    for rank in range(world):
        x = _tokens(rank).requires_grad_()
        out = block(x)
        _loss(out, rank).backward()
        outs.append({"out": out.detach(), "x_grad": x.grad, "router": block.gate.weight.grad.clone()})
    return outs, block.experts.gate_up_proj.grad, block.experts.down_proj.grad


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}\n{m}")


def test_autoep_block_equals_the_transformers_block_in_one_process():
    got = _run(1)
    (want,), gate_up, down = _reference(1)
    _close(got["out"], want["out"], "output")
    _close(got["x_grad"], want["x_grad"], "input gradient")
    _close(got["gate_up"], gate_up, "gate_up_proj gradient")
    _close(got["down"], down, "down_proj gradient")


def test_autoep_block_on_two_ranks_with_different_token_counts_equals_the_transformers_block():
    want, gate_up, down = _reference(2)
    (one,), one_gate_up, one_down = _reference(1)  # rank 0's tokens alone: what the folded pair computes
    for rank, (got, folded) in enumerate(run_ranks(_unfolded_and_folded, 2, timeout=120)):
        rows = slice(rank * E // 2, (rank + 1) * E // 2)
        _close(got["out"], want[rank]["out"], f"rank {rank} output")
        _close(got["x_grad"], want[rank]["x_grad"], f"rank {rank} input gradient")
        _close(got["gate_up"], gate_up[rows], f"rank {rank} gate_up_proj gradient")
        _close(got["down"], down[rows], f"rank {rank} down_proj gradient")
        _close(folded["out"], one["out"], f"folded rank {rank} output")
        _close(folded["x_grad"], one["x_grad"], f"folded rank {rank} input gradient")
        _close(folded["router"], one["router"], f"folded rank {rank} router gradient")
        _close(folded["gate_up"], one_gate_up[rows], f"folded rank {rank} gate_up_proj gradient")
        _close(folded["down"], one_down[rows], f"folded rank {rank} down_proj gradient")
