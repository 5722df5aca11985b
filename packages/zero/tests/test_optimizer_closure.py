"""``step(closure)`` on zero's own optimizers behaves as torch's: the closure re-evaluates the loss with gradients
enabled (a user's LBFGS-style loop recomputes ``.grad`` inside it), the step uses the gradients it produced, and
the step returns the closure's loss."""

import pytest
import torch

from zero.optim.lamb import Lamb
from zero.optim.lion import Lion
from zero.optim.muon import Muon


def _build(name: str, w: torch.nn.Parameter) -> torch.optim.Optimizer:
    if name == "lion":
        return Lion([w], lr=0.01)
    if name == "lamb":
        return Lamb([w], lr=0.01)
    return Muon([{"params": [w], "use_muon": True, "lr": 0.02}])


@pytest.mark.parametrize("name", ["lion", "lamb", "muon"])
def test_step_with_closure_returns_its_loss_and_steps_on_its_gradients(name):
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    w0 = torch.randn(4, 4)

    def run(with_closure: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.nn.Parameter(w0.clone())
        opt = _build(name, w)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (x @ w).square().mean()
            loss.backward()  # needs grad mode: step() runs under torch.no_grad
            return loss

        if with_closure:
            with torch.no_grad():
                got = opt.step(closure)
        else:
            closure()
            got = opt.step()
        return w.detach(), got

    stepped, loss = run(with_closure=True)
    reference, none = run(with_closure=False)
    assert none is None
    assert loss is not None and torch.equal(loss, (x @ w0).square().mean())
    assert torch.equal(stepped, reference)
    assert not torch.equal(stepped, w0)
