"""``engine.allreduce_gradients()`` called after each ``engine.backward`` (as scripts written for DeepSpeed's
``enable_backward_allreduce=False`` path do), at ZeRO stages 0-3, with one and with two micro-batches per step, on two
gloo ranks: the gradients were already reduced by the backward (DeepSpeed's backward calls it itself), so the call
changes nothing and the parameters after two steps equal the run without it, bit for bit. DeepSpeed 0.19.8 gives the
same at stages 0 and 3 and raises IndexError (``reduce_ipg_grads`` on an empty bucket) at stages 1 and 2."""

import torch
import torch.distributed as dist

import zero
from zero_comm.testing import run_ranks

STEPS = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(stage: int, gas: int, extra_call: bool) -> dict[str, torch.Tensor]:
    net = _model()
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "zero_optimization": {"stage": stage}}  # fmt: skip
    engine = zero.initialize(model=net, config=cfg)[0]
    for micro in range(STEPS * gas):
        g = torch.Generator().manual_seed(100 * micro + dist.get_rank())
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if extra_call:
            engine.allreduce_gradients()
        engine.step()
    params = list(engine.module.named_parameters())
    with zero.GatheredParameters([p for _, p in params]):
        out = {n: p.detach().clone() for n, p in params}
    engine.destroy()
    return out


def _cases() -> dict[tuple[int, int], tuple[bool, bool]]:
    """Per (stage, micro-batches per step): (the parameters equal the run without the call, they were trained)."""
    start = dict(_model().named_parameters())
    out = {}
    for stage in (0, 1, 2, 3):
        for gas in (1, 2):
            plain, called = _train(stage, gas, False), _train(stage, gas, True)
            out[(stage, gas)] = (all(torch.equal(plain[n], called[n]) for n in plain),
                                 all(not torch.equal(plain[n], start[n]) for n in plain))  # fmt: skip
    return out


def test_allreduce_gradients_after_backward_changes_nothing():
    for rank, got in enumerate(run_ranks(_cases, 2, timeout=180)):
        assert got == {(stage, gas): (True, True) for stage in (0, 1, 2, 3) for gas in (1, 2)}, (rank, got)
