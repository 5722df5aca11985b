"""Crash safety, integrity and async save: SIGKILL mid-write keeps the previous checkpoint loadable; corrupt,
truncated or missing files are named; loading never unpickles; async saves snapshot state and are awaited."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig, ZeroRuntime
from zero_core.checkpoint import CheckpointError, ConsolidatedState, load_checkpoint, save_checkpoint
from zero_core.checkpoint.storage import check_tag


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 7))


def runtime(seed=0, stage=2):
    m = model()
    torch.manual_seed(seed)
    for p in m.parameters():
        p.data.normal_()
    return ZeroRuntime(m, torch.optim.AdamW(m.parameters(), lr=1e-2), ZeroConfig(stage=stage))


def step(rt, seed):
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    rt.backward(rt.module(torch.randn(4, 64, generator=g)).pow(2).mean())
    rt.step()


def masters(rt):
    return [m.detach().clone() for g in rt.flat_groups if (m := rt.master.master_shard(g)) is not None]


# A process that saves "good", then dies by SIGKILL in the middle of saving "next" (after its first file is on
# disk and before the commit). The pause is injected here, in the test, by wrapping the JSON writer.
CRASHER = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    sys.path.insert(0, os.path.dirname(sys.argv[1]))
    import importlib.util
    spec = importlib.util.spec_from_file_location("t", sys.argv[1]); t = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(t)
    from zero_core.checkpoint import save_checkpoint, storage
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    rt = t.runtime()
    t.step(rt, 1)
    save_checkpoint(rt, sys.argv[2], "good")
    t.step(rt, 2)
    real = storage.write_json
    def slow(path, obj):
        rec = real(path, obj)
        print("MIDWRITE", flush=True)
        time.sleep(120)
        return rec
    storage.write_json = slow
    save_checkpoint(rt, sys.argv[2], "next")
    """
)


def _load_good_body(root, expected):
    rt = runtime(seed=5)
    res = load_checkpoint(rt, root)
    assert res.tag == "good", res.tag
    assert all(torch.equal(a, b) for a, b in zip(masters(rt), expected))
    save_checkpoint(rt, root, "next")  # the stale staging directory of the killed save is replaced
    assert load_checkpoint(runtime(seed=6), root).tag == "next"
    return True


def _good_masters_body():
    rt = runtime()
    step(rt, 1)
    return masters(rt)


def test_sigkill_mid_save_keeps_previous_checkpoint():
    with tempfile.TemporaryDirectory() as root:
        proc = subprocess.Popen(
            [sys.executable, "-c", CRASHER, __file__, root], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            line = proc.stdout.readline()
            assert line.strip() == "MIDWRITE", (line, proc.stderr.read() if proc.poll() is not None else "")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        root_path = pathlib.Path(root)
        assert (root_path / "latest").read_text() == "good"
        assert not (root_path / "next").exists() and (root_path / ".next.tmp").is_dir()
        expected = run_ranks(_good_masters_body, 1, timeout=60)[0]
        assert run_ranks(_load_good_body, 1, root, expected, timeout=60) == [True]


def _save_body(root, async_save):
    rt = runtime()
    step(rt, 1)
    at_save = masters(rt)
    handle = save_checkpoint(rt, root, "a", async_save=async_save, client_state={"x": 1})
    step(rt, 2)  # training goes on while the background thread writes: the snapshot must not see this step
    step(rt, 3)
    handle.wait(timeout=60)
    assert handle.done()
    loaded = runtime(seed=9)
    load_checkpoint(loaded, root, "a")
    assert all(torch.equal(a, b) for a, b in zip(masters(loaded), at_save))
    # a later save waits for a pending one, and `latest` follows the order of saves
    save_checkpoint(rt, root, "b", async_save=True)
    save_checkpoint(rt, root, "c", async_save=True).wait(timeout=60)
    assert open(f"{root}/latest").read() == "c"
    return True


def test_async_save_snapshots_state_and_is_awaited():
    with tempfile.TemporaryDirectory() as root:
        assert run_ranks(_save_body, 2, root, True, timeout=120) == [True, True]


def _two_ckpts_body(root):
    rt = runtime()
    step(rt, 1)
    save_checkpoint(rt, root, "t")
    return True


def test_corrupt_truncated_and_missing_files_are_named():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_two_ckpts_body, 2, root, timeout=60)
        ckpt = pathlib.Path(root) / "t"
        manifest = json.loads((ckpt / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and manifest["stage"] == 2
        assert sorted(manifest["files"]) == sorted(
            [
                "mp_rank_00_model_states.json",
                "mp_rank_00_model_states.safetensors",
                "zero_pp_rank_0_mp_rank_00_optim_states.json",
                "zero_pp_rank_0_mp_rank_00_optim_states.safetensors",
                "zero_pp_rank_1_mp_rank_00_optim_states.json",
                "zero_pp_rank_1_mp_rank_00_optim_states.safetensors",
            ]
        )
        ConsolidatedState(root).tensor("0.weight")  # intact: reads fine
        victim = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.safetensors"
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.safetensors is corrupt"):
            ConsolidatedState(root).tensor("0.weight")
        victim.write_bytes(bytes(data[:-10]))
        with pytest.raises(CheckpointError, match=r"optim_states.safetensors is truncated or altered: \d+ bytes"):
            ConsolidatedState(root).tensor("0.weight")
        victim.unlink()
        with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_00_optim_states.safetensors is missing"):
            ConsolidatedState(root).tensor("0.weight")
        (ckpt / "mp_rank_00_model_states.json").write_text("{}")
        with pytest.raises(CheckpointError, match="mp_rank_00_model_states.json is truncated or altered"):
            ConsolidatedState(root)
        os.remove(ckpt / "manifest.json")
        with pytest.raises(CheckpointError, match="has no manifest.json"):
            ConsolidatedState(root)


def test_no_pickles_on_disk_and_tags_are_checked():
    with tempfile.TemporaryDirectory() as root:
        run_ranks(_two_ckpts_body, 1, root, timeout=60)
        for f in (pathlib.Path(root) / "t").iterdir():
            head = f.read_bytes()[:2]
            assert head not in (b"\x80\x02", b"\x80\x04", b"PK"), f"{f.name} looks like a pickle / torch.save zip"
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="checkpoint tag"):
            check_tag(bad)
