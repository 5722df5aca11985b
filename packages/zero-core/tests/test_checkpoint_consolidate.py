"""Offline consolidation to one fp32 file: 1-3 param groups of uneven sizes, ws 2 and 3, every stage, fp32 and bf16
(fp32 master), each world size x dtype pair; consolidated in the test process, which holds no rank. Exact keys and
shapes, frozen params and buffers included, bitwise equal to the job's own gathered masters, strict-loadable."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import PrecisionPolicy, ZeroConfig, ZeroRuntime
from zero_core.checkpoint import ConsolidatedState, consolidate, full_state_dict, save_checkpoint, save_model_weights

STAGES = [0, 1, 2, 3]


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(7, 13)
        self.emb.requires_grad_(False)  # frozen: consolidated at full shape all the same
        self.fc1 = nn.Linear(13, 11)
        self.fc2 = nn.Linear(11, 5)
        self.register_buffer("running", torch.arange(5.0))
        self.register_buffer("count", torch.tensor(3))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(torch.tanh(self.emb(x))))) + self.running


def param_groups(model, n):
    """n optimizer param groups of uneven sizes."""
    parts = [[model.fc1.weight, model.fc2.weight, model.fc1.bias, model.fc2.bias]]
    if n == 2:
        parts = [[model.fc1.weight, model.fc2.bias], [model.fc2.weight, model.fc1.bias]]
    if n == 3:
        parts = [[model.fc1.weight], [model.fc2.weight, model.fc2.bias], [model.fc1.bias]]
    return [{"params": p, "lr": 1e-2 * (i + 1)} for i, p in enumerate(parts)]


def _body(root, dtypes):
    rank = dist.get_rank()
    expected = {}
    for dtype in dtypes:
        for n_groups in (1, 2, 3):
            for stage in STAGES:
                torch.manual_seed(0)
                model = TinyNet()
                opt = torch.optim.AdamW(param_groups(model, n_groups))
                precision = PrecisionPolicy.fp32() if dtype == torch.float32 else PrecisionPolicy.bf16()
                rt = ZeroRuntime(model, opt, ZeroConfig(stage=stage, reduce_bucket_size=50), precision)
                for step in range(2):
                    g = torch.Generator().manual_seed(10 * step + rank)
                    rt.backward(model(torch.randn(3, 7, generator=g)).float().pow(2).mean())
                    rt.step()
                tag = f"g{n_groups}-s{stage}-{str(dtype)[6:]}"
                save_checkpoint(rt, f"{root}/{tag}", "t", model_config={"model_type": "tiny", "n": n_groups})
                live = full_state_dict(rt)
                save_model_weights(rt, f"{root}/{tag}-live")
                masters = rt.full_parameters()  # zero_core's own gather: the reference
                if rank == 0:
                    expected[tag] = {"masters": masters, "live": live, "frozen": model.emb.weight.detach().clone()}
    return expected if rank == 0 else None


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """world size -> (folder, tag -> rank 0's in-memory values): one launch per world size, fp32 and bf16 runs."""
    runs = {}

    def get(world):
        if world not in runs:
            root = str(tmp_path_factory.mktemp(f"ws{world}"))
            runs[world] = root, run_ranks(_body, world, root, (torch.float32, torch.bfloat16), timeout=240)[0]
        return runs[world]

    return get


@pytest.mark.parametrize("world", [2, 3])
def test_consolidation_matches_gathered_masters(saved, world):
    root, expected = saved(world)
    assert len(expected) == 2 * 3 * len(STAGES)
    shapes = {k: v.shape for k, v in TinyNet().state_dict().items()}
    keys = list(shapes)
    for tag, exp in expected.items():
        assert not dist.is_initialized()  # offline: this process is no rank of any group
        out = f"{root}/{tag}-out"
        path = consolidate(f"{root}/{tag}", out)
        state = load_file(path)
        assert list(state) == keys, tag  # exactly the model's keys, in its order
        assert {k: v.shape for k, v in state.items()} == shapes, tag  # original shapes, buffers included
        assert set(exp["masters"]) == {n for n, _ in TinyNet().named_parameters()}, tag  # every parameter compared
        for k, v in exp["masters"].items():
            assert state[k].dtype == torch.float32 and torch.equal(state[k], v), f"{tag}: {k}"
        # frozen params in fp32 at full shape, equal to the model's (bf16-rounded) values
        assert torch.equal(state["emb.weight"], exp["frozen"].float()), tag
        assert torch.equal(state["running"], torch.arange(5.0)) and state["count"].item() == 3
        plain = TinyNet()
        plain.load_state_dict(state, strict=True)
        # the running job's full state dict and weights file say the same
        assert list(exp["live"]) == keys
        live_file = load_file(f"{root}/{tag}-live/model.safetensors")
        for k in keys:
            assert torch.equal(exp["live"][k], state[k]) and torch.equal(live_file[k], state[k]), f"{tag}: {k}"
        assert open(f"{out}/config.json").read().count('"n"') == 1
    assert not dist.is_initialized()
    # torch format, read back with weights_only=True
    tag = next(iter(expected))
    path = consolidate(f"{root}/{tag}", f"{root}/torch-out", fmt="torch")
    state = torch.load(path, weights_only=True)
    assert list(state) == list(TinyNet().state_dict())
    for k, v in load_file(f"{root}/{tag}-out/model.safetensors").items():
        assert torch.equal(state[k], v), k


def test_consolidated_state_streams_one_tensor_at_a_time(saved):
    root, _ = saved(2)
    state = ConsolidatedState(f"{root}/g2-s2-float32")
    specs = state.specs()
    assert [s[0] for s in specs] == list(TinyNet().state_dict())
    assert dict((n, tuple(s)) for n, _, s in specs)["fc1.weight"] == (11, 13)
    assert state.tensor("count").dtype == torch.int64
