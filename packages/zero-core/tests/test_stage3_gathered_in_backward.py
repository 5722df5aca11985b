"""Stage 3 with a weight read directly, outside its module, by a custom autograd function that gathers it with
``GatheredParameters`` in its forward and again in its backward, where it recomputes the logits (a fused LM head, as
TRL's trainers patch onto a causal LM: the head module itself never runs). The function returns the weight's
full-shape gradient after its block has ended; autograd then accumulates it into the parameter, which must still
have its full shape. Before, the block's exit released the unit first and accumulating failed ("The size of tensor a
(0) must match the size of tensor b ..."). Checked against one process running the same function on whole
parameters (AdamW, fp32), and the unit is released again once backward is over."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, PrecisionPolicy, ZeroConfig, ZeroRuntime

VOCAB, DIN, STEPS, ACCUMULATE = 13, 8, 3, 2


class _HeadLoss(torch.autograd.Function):
    """Mean cross entropy of ``hidden @ weight.T`` against ``target`` (hidden ``[N, DIN]``, weight ``[VOCAB, DIN]``,
    target ``[N]`` int64), called with the weight gathered; the logits are not kept for backward but recomputed
    there from the weight, gathered again."""

    @staticmethod
    def forward(ctx, hidden, weight, target):
        ctx.save_for_backward(hidden, weight, target)
        return nn.functional.cross_entropy(hidden @ weight.t(), target)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, target = ctx.saved_tensors
        with GatheredParameters(weight):
            probs = (hidden @ weight.t()).softmax(-1)
            probs[torch.arange(len(target)), target] -= 1
            probs *= grad / len(target)
            return probs @ weight, probs.t() @ hidden, None


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(DIN, DIN)
        self.head = nn.Linear(DIN, VOCAB, bias=False)  # its forward never runs: the loss reads its weight

    def forward(self, x, target):
        hidden = torch.tanh(self.body(x))
        with GatheredParameters(self.head.weight):  # whole parameters (the single-process reference): no-op
            return _HeadLoss.apply(hidden, self.head.weight, target)


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(6, DIN, generator=gen), torch.randint(0, VOCAB, (6,), generator=gen)


def _body() -> dict:
    torch.manual_seed(0)
    model = _Net()
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=0)
    rt = ZeroRuntime(model, torch.optim.AdamW(model.parameters(), lr=0.05), cfg, PrecisionPolicy.fp32())
    losses, released = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            loss = rt.module(*_batch(step, micro, dist.get_rank()))
            rt.backward(loss / ACCUMULATE, is_boundary=micro == ACCUMULATE - 1)
            losses.append(loss.item())
            released.append(model.head.weight.numel() == 0 and model.body.weight.numel() == 0)
        rt.step()
    out = {"losses": losses, "released": released, "params": dict(rt.full_parameters())}
    rt.close()
    return out


def test_gradient_of_a_weight_gathered_in_a_custom_backward_equals_one_process():
    world = 2
    torch.manual_seed(0)
    ref = _Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    want_losses = {r: [] for r in range(world)}
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            for r in range(world):
                loss = ref(*_batch(step, micro, r))
                (loss / ACCUMULATE / world).backward()
                want_losses[r].append(loss.item())
        opt.step()
    for rank, got in enumerate(run_ranks(_body, world, timeout=120, threads=1)):
        assert got["losses"] == pytest.approx(want_losses[rank], rel=1e-5), rank
        assert all(got["released"]), got["released"]  # the kept unit went back once its gradient was in
        for name, want in ref.named_parameters():
            torch.testing.assert_close(got["params"][name], want.detach(), atol=1e-6, rtol=1e-5, msg=name)
