"""Profile output: table options (module_depth, top_modules, detailed), JSON, output_file, get_model_profile."""

import json

import pytest
import torch
from torch import nn

from zero_profiler import FlopsProfiler, get_model_profile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 10, bias=False)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


# Per token: up 16x32 MACs + 32 bias + 32 relu; down 32x16 MACs + 16 bias; head 16x10 MACs.
BLOCK_FLOPS = 2 * 512 + 32 + 32 + 2 * 512 + 16
HEAD_FLOPS = 2 * 160


def _profile(tokens=6):
    torch.manual_seed(0)
    model = Net()
    with FlopsProfiler(model) as prof:
        model(torch.randint(0, 10, (tokens,)))
    return prof


def test_tree_holds_exact_counts_and_params():
    p = _profile().profile
    rows = {m.path: m for m in p.modules}
    assert list(rows) == ["", "embed", "blocks", "blocks.0", "blocks.0.up", "blocks.0.down", "blocks.1",
                          "blocks.1.up", "blocks.1.down", "head"]  # fmt: skip
    assert rows["blocks.0"].flops == 6 * BLOCK_FLOPS
    assert rows[""].flops == p.forward.flops == 6 * (2 * BLOCK_FLOPS + HEAD_FLOPS)
    assert rows["embed"].flops == 0
    block_params = 16 * 32 + 32 + 32 * 16 + 16
    assert (rows["blocks.1"].params, rows["embed"].params) == (block_params, 160)
    assert p.total_params == 160 + 2 * block_params + 160
    assert p.non_embedding_params == p.total_params - 160
    assert [rows[k].depth for k in ("", "blocks", "blocks.0", "blocks.0.up")] == [0, 1, 2, 3]


def test_format_respects_module_depth_top_modules_detailed():
    p = _profile().profile
    full = p.format()
    tree = full.split("Per-module")[1]
    assert "blocks.0.up" not in tree and "      up  " in tree and "(root)" in tree  # leaf names, indented
    shallow = p.format(module_depth=1, top_modules=0)
    assert "Top" not in shallow and "  blocks " in shallow and "up" not in shallow.split("Per-module")[1]
    top = p.format(module_depth=2, top_modules=2, detailed=False)
    assert "Per-module" not in top
    depth2 = next(line for line in top.splitlines() if line.startswith("  depth 2:"))
    assert "FLOPs blocks.0" in depth2 and "blocks.1" in depth2
    with pytest.raises(ValueError, match="module_depth must be -1"):
        p.format(module_depth=-2)
    with pytest.raises(ValueError, match="top_modules must be >= 0, got -1"):
        p.format(top_modules=-1)


def test_tokens_line_states_ratio_to_six_n():
    p = _profile(tokens=6).profile
    text = p.format(tokens=6, step=3)
    assert text.startswith("zero flops profiler - step 3")
    ratio = p.flops_per_token(6) / (6 * p.non_embedding_params)
    assert f"{ratio:.3f} x (6 x non-embedding params)" in text
    with pytest.raises(ValueError, match="tokens must be a positive count, got 0"):
        p.flops_per_token(0)


def test_json_and_output_file(tmp_path, capsys):
    prof = _profile()
    data = json.loads(prof.profile.to_json())
    assert data["totals"]["forward"]["flops"] == prof.get_total_flops()
    assert data["totals"]["params"] == prof.get_total_params()
    assert [m["path"] for m in data["modules"]][:3] == ["", "embed", "blocks"]
    prof.print_model_profile(profile_step=1, output_file=str(tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text()) == data
    text = prof.print_model_profile(profile_step=1, module_depth=1, output_file=str(tmp_path / "p.txt"))
    assert (tmp_path / "p.txt").read_text() == text + "\n"
    assert capsys.readouterr().out == ""
    prof.print_model_profile(top_modules=1)
    assert "zero flops profiler" in capsys.readouterr().out
    prof.end_profile()
    with pytest.raises(RuntimeError, match="no profile yet"):
        prof.get_total_flops()


def test_get_model_profile_forward_only_and_with_backward(capsys):
    lin = nn.Linear(8, 16)
    p = get_model_profile(lin, input_shape=(4, 8), print_profile=False)
    assert (p.forward.macs, p.forward.flops, p.total_params) == (512, 1088, 144)
    assert p.backward.flops == 0 and capsys.readouterr().out == ""
    x = torch.randn(4, 8, requires_grad=True)
    p = get_model_profile(lin, args=(x,), loss_fn=lambda out: out.sum(), warm_up=2, print_profile=True)
    assert p.backward.macs == 1024 and lin.weight.grad is None
    assert "zero flops profiler" in capsys.readouterr().out
    with pytest.raises(ValueError, match="exactly one of input_shape or args/kwargs"):
        get_model_profile(lin, input_shape=(4, 8), args=(x,))
    with pytest.raises(ValueError, match="warm_up must be >= 0, got -1"):
        get_model_profile(lin, input_shape=(4, 8), warm_up=-1)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        FlopsProfiler(3)
