"""The README's data-parallel example (zero-comm alone: hooks launch bucketed all-reduces during backward) runs on
2 gloo ranks and matches single-process SGD on the global batch."""

import importlib.util
import pathlib
import re

import pytest
import torch

from zero_comm.testing import run_ranks

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _load_example(tmp_path):
    text = README.read_text()
    code = re.search(r"<!-- example-start -->\n```python\n(.*?)```\n<!-- example-end -->", text, re.S).group(1)
    assert len(code.splitlines()) <= 50, "the README example should stay about 40 lines"
    path = tmp_path / "zero_comm_readme_example.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("zero_comm_readme_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(world: int, steps: int, lr: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(world, 4, 5, generator=data), torch.randn(world, 4, 1, generator=data)
        out = model(x.view(-1, 5)).view(world, 4, 1)
        per_rank = ((out - y) ** 2).mean(dim=(1, 2))
        model.zero_grad()
        per_rank.mean().backward()  # equal micro-batches: the mean of rank means is the global mean
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        losses.append(per_rank.detach())
    return torch.stack(losses), [p.detach() for p in model.parameters()]


@pytest.mark.smoke
def test_readme_example_matches_single_process(tmp_path):
    mod = _load_example(tmp_path)
    results = run_ranks(mod.train, 2, 5, 0.1, timeout=60)
    ref_losses, ref_params = _reference(2, 5, 0.1)
    for rank, (losses, params) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), ref_losses[:, rank], rtol=1e-6, atol=1e-6)
        for p, ref in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    initial = torch.nn.Linear(5, 7).weight.detach()
    assert (results[0][1][0] - initial).abs().max() > 1e-3  # training moved the weights
