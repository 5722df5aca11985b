"""Checkpoints with third-party types: a transformers model consolidates into a folder that ``from_pretrained``
loads (config.json, tied weights), and numpy values and numpy's RNG state survive a save/load round trip."""

import json
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import transformers

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime
from zero_core.checkpoint import consolidate, load_checkpoint, save_checkpoint
from zero_core.checkpoint.codec import decode, encode


def _gpt2_body(root):
    config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=12, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = ZeroRuntime(model, opt, ZeroConfig(stage=2))
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    rt.backward(model(ids, labels=ids).loss)
    rt.step()
    save_checkpoint(rt, f"{root}/ckpt", "t", model_config=config.to_dict())
    model.eval()  # from_pretrained returns an eval-mode model: no dropout on either side
    return ids, model(ids).logits.detach(), rt.full_parameters()


def test_transformers_model_consolidates_to_from_pretrained():
    with tempfile.TemporaryDirectory() as root:
        (ids, logits, masters), _ = run_ranks(_gpt2_body, 2, root, timeout=120)
        consolidate(f"{root}/ckpt", f"{root}/out")
        model = transformers.GPT2LMHeadModel.from_pretrained(f"{root}/out")
        loaded = dict(model.named_parameters())
        for k, v in masters.items():
            assert torch.equal(loaded[k].detach(), v), k
        assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)  # tied: both keys written
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)


def test_codec_round_trips_numpy_values():
    obj = {"a": np.arange(4, dtype=np.uint32), "s": np.float32(2.5), "state": np.random.RandomState(3).get_state()}
    tensors = {}
    back = decode(json.loads(json.dumps(encode(obj, tensors, "c"))), tensors)
    assert back["a"].dtype == np.uint32 and back["a"].tolist() == [0, 1, 2, 3]
    assert back["s"] == 2.5 and back["s"].dtype == np.float32
    rs = np.random.RandomState()
    rs.set_state(back["state"])
    assert rs.randint(0, 1 << 30) == np.random.RandomState(3).randint(0, 1 << 30)


def _numpy_rng_body(root):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    rt = ZeroRuntime(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=1))
    np.random.seed(11)
    np.random.rand(5)
    save_checkpoint(rt, root, "t")
    expected = np.random.rand(3)
    np.random.seed(99)
    load_checkpoint(rt, root)
    return bool((np.random.rand(3) == expected).all())


def test_numpy_rng_state_is_restored():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_numpy_rng_body, 2, root, timeout=60) == [True, True]
