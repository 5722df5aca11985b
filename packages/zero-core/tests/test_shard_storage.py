"""Stage 3's storage seam (``zero_core.shard_storage``): a storage policy of the test's own, keeping each unit's
chunk as a separate tensor off the store's view, is given to ``Stage3`` through a builder for
``ZeroRuntime(param_store=...)``; training, ``GatheredParameters`` edits and a checkpoint round trip then equal the
default store's run exactly (fp32, 2 ranks, a tied and a frozen parameter, persistent and sharded units), every chunk
reaches its all-gather through ``source`` and comes back through ``gathered``, and the store keeps nothing of its
own on the device between uses."""

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import GatheredParameters, ParamStoreInputs, ShardStorage, ZeroConfig, ZeroRuntime
from zero_core.stage3 import Stage3


class ChunkShards:
    """Each unit's stored chunk as its own tensor (in a dict), handed to a gather as a copy: a storage with no shard
    view, so the store takes the path an offloaded storage takes."""

    offloaded = False
    batches = False

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.chunks: dict = {}  # bucket -> its stored chunk
        self.staged: dict = {}  # bucket -> the copy its gather in flight sends
        self.sources = self.ahead = self.gathered_count = self.flushes = 0

    def allocate(self, groups):
        for g in groups:
            for b in g.buckets:
                self.chunks[b] = torch.zeros(b.chunk, dtype=self.dtype)

    def shard(self, g):
        return None

    def source(self, b, ahead, schedule):
        self.sources += 1
        self.ahead += int(ahead)
        self.staged[b] = self.chunks[b].clone()
        return self.staged[b]

    def gathered(self, b):
        self.gathered_count += 1
        del self.staged[b]

    def read_chunk(self, b):
        return self.chunks[b]

    def open_chunk(self, b, keep):
        return self.chunks[b]

    def close_chunk(self, b):
        pass

    def flush(self):
        self.flushes += 1

    def resident(self):
        return []

    def close(self):
        self.chunks.clear()


class Net(nn.Module):
    """Uneven sizes; ``head`` shares ``emb``'s weight; ``frozen`` takes no gradient; biases are persistent units."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(6, 7)
        self.head = nn.Linear(7, 11, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(torch.tanh(self.frozen(self.emb(x))))))


def _runtime(storage):
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=7, stage3_prefetch_bucket_size=10**6)

    def build(inputs: ParamStoreInputs) -> Stage3:
        return Stage3.from_inputs(inputs, storage=storage)

    return ZeroRuntime(model, opt, cfg, param_store=build if storage is not None else None)


def _train(rt, steps=3):
    losses = []
    for step in range(steps):
        x = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        loss = nn.functional.cross_entropy(rt.module(x).flatten(0, 1), x.flatten())
        rt.backward(loss)
        rt.step()
        losses.append(loss.item())
    return losses


def _body():
    storage = ChunkShards(torch.float32)
    assert isinstance(storage, ShardStorage)  # what a third-party policy implements
    ref, own = _runtime(None), _runtime(storage)
    assert own.params.storage is storage and all(own.params.shard_view(g) is None for g in own.flat_groups)
    out = {"losses": (_train(ref), _train(own)), "gathers": own.params.gathers}
    out["counts"] = (storage.sources, storage.gathered_count, len(storage.staged), storage.ahead)
    out["bytes"] = (own.model_state_bytes()["params"], ref.model_state_bytes()["params"])
    out["persistent"] = sum(b.padded_numel * 4 for g in own.flat_groups for b in g.buckets if b.persistent)
    for rt in (ref, own):  # an edit reaches the stored chunk (and the master) wherever the storage keeps it
        with GatheredParameters([rt.module.fc.weight], modifier_rank=0):
            if dist.get_rank() == 0:
                with torch.no_grad():
                    rt.module.fc.weight.mul_(0.5)
    out["edited"] = (_train(ref, 1), _train(own, 1))
    for rt in (ref, own):  # a checkpoint's shards go back in (the frozen group through load_frozen)
        rt.load_master_shards([s.clone() for s in rt.shards()])
    out["loaded"] = (_train(ref, 1), _train(own, 1))
    out["full"] = (ref.full_parameters(), own.full_parameters())
    ref.close()
    own.close()
    out["closed"] = (len(storage.chunks), [p.numel() for p in own.module.parameters()])
    return out


def test_a_storage_policy_of_ones_own_trains_as_the_default_store():
    for out in run_ranks(_body, 2, timeout=180, threads=1):
        for key in ("losses", "edited", "loaded"):
            ref, own = out[key]
            assert own == ref, (key, own, ref)  # the same values gathered: bitwise the same run
        ref, own = out["full"]
        assert ref.keys() == own.keys()
        for k in ref:
            assert torch.equal(ref[k], own[k]), k
        sources, gathered, staged, ahead = out["counts"]
        # every gather of a unit sent what source gave, and gave it back; prefetches came through it too
        assert sources == gathered >= out["gathers"] > 0 and staged == 0 and ahead > 0, out["counts"]
        params, ref_params = out["bytes"]
        assert params == out["persistent"] < ref_params  # nothing of the stored shards on the device
        assert out["closed"][0] == 0 and all(n > 0 for n in out["closed"][1])
