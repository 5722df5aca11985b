"""NVMe optimizer state: equal to the in-memory step, swapping counted, the swap folder's rules, named errors."""

import errno
import os
import subprocess
import sys

import pytest
import torch

from zero_kernels.aio import AioError, AioSettings, AsyncIO
from zero_offload.host_optimizer import HostOptimizer
from zero_offload.nvme_optimizer import NVMeOptimizer, swap_bytes
from zero_offload.swap_folder import SwapFolder, SwapFolderError

SIZES = (3000, 1700)  # sub-groups of 1024: 3 + 2 = 5 of them, through a ring of 2 buffers


def _pair(tmp_path, **kw):
    torch.manual_seed(0)
    masters = [torch.randn(n) for n in SIZES]
    user = torch.optim.AdamW([{"params": [torch.nn.Parameter(m.clone())]} for m in masters], lr=1e-2)
    host = HostOptimizer(masters, [0, 1], user, sub_group_size=1024)
    folder = SwapFolder(str(tmp_path), rank=0, bytes_needed=swap_bytes(SIZES, 1024))
    io = AsyncIO(AioSettings(block_size=8192, queue_depth=2), str(tmp_path))
    kw = {"buffer_count": 2, **kw}
    nvme = NVMeOptimizer(masters, [0, 1], user, folder=folder, io=io, sub_group_size=1024, **kw)
    return host, nvme, io


def _feed(opt, k):
    g = torch.Generator().manual_seed(k)
    opt.zero_grad()
    for s, n in enumerate(SIZES):
        opt.receive_grad(s, 0, torch.randn(n, generator=g))


@pytest.mark.parametrize("pipeline, out_dtype", [(True, torch.float32), (False, torch.float32),
                                                 (True, torch.bfloat16)])  # fmt: skip
def test_matches_in_memory_step_and_counts_swaps(tmp_path, pipeline, out_dtype):
    host, nvme, io = _pair(tmp_path, pipeline_read=pipeline, pipeline_write=pipeline, out_dtype=out_dtype)
    assert len(nvme.sub_groups) == 5 and nvme.ring.numel == 2 * 3 * 1024  # 2 buffers of the largest sub-group
    assert sum(map(nvme.region_numel, nvme.sub_groups)) > nvme.ring.numel  # swapping really happens
    r0, w0, br0, bw0 = io.reads, io.writes, io.bytes_read, io.bytes_written
    for k, coef in enumerate((1.0, 0.5, 0.25)):
        _feed(host, k)
        _feed(nvme, k)
        host.step(coef)
        nvme.step(coef)
    assert (io.reads - r0, io.writes - w0) == (15, 15)  # one read and one write per sub-group per step
    # fp32: the master is the host copy, so only the two moments move (each segment padded to 4 KiB); bf16
    # storage: the fp32 master moves too
    segments = 2 if out_dtype == torch.float32 else 3
    moved = 3 * sum(segments * pad * 4 for pad in nvme._pad)
    assert nvme.master_in_memory == (out_dtype == torch.float32)
    assert (io.bytes_read - br0, io.bytes_written - bw0) == (moved, moved)
    for s in range(len(SIZES)):
        assert torch.equal(nvme.master_shard(s), host.master_shard(s))
        out = torch.empty(SIZES[s], dtype=out_dtype)
        nvme.write_back(s, out)
        assert torch.equal(out, host.master_shard(s).to(out_dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(nvme.shard_state(s)[key], host.shard_state(s)[key])
    nvme.close()


def _same(host, nvme):
    for s in range(len(SIZES)):
        assert torch.equal(nvme.master_shard(s), host.master_shard(s))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(nvme.shard_state(s)[key], host.shard_state(s)[key])


@pytest.mark.parametrize("buffer_count, early", [(4, 5), (2, 3)])
def test_first_reads_start_with_the_first_gradient(tmp_path, buffer_count, early):
    # the step's reads start with its first gradient at the latest (in training: as backward begins), as many as
    # the ring holds (each sub-group takes its two moments' 2 x 1024 elements of the buffer_count x 3 x 1024), so
    # they overlap backward; a state read between backward and the step, or a skipped sub-group, drops them
    # without using stale room
    host, nvme, io = _pair(tmp_path, buffer_count=buffer_count)
    assert nvme.ring.numel == buffer_count * 3 * 1024 and nvme.region_numel(nvme.sub_groups[0]) == 2 * 1024
    r0 = io.reads
    for k, coef in enumerate((1.0, 0.5)):
        _feed(host, k)
        _feed(nvme, k)
        assert io.reads - r0 == early  # started with the gradients, before the step
        host.step(coef)
        nvme.step(coef)
        assert io.reads - r0 == len(nvme.sub_groups)  # the step used them: one read per sub-group in all
        r0 = io.reads
    _same(host, nvme)
    _feed(host, 2)
    _feed(nvme, 2)
    _same(host, nvme)  # reads the state through the ring while the early reads were pending
    _feed(host, 3)
    _feed(nvme, 3)
    host.step(0.25, frozenset({1}))
    nvme.step(0.25, frozenset({1}))  # sub-group 1 read early, then skipped: its room goes back unused
    _same(host, nvme)
    nvme.close()


def test_no_read_of_a_sub_group_while_its_write_is_pending(tmp_path):
    # DeepSpeed 0.18 fixed a checkpoint that read swap files still being written. Here every write is slow (a
    # fault hook), and step() returns with its writes in flight: the next step's reads of the same files, the
    # reads a checkpoint makes and flush() all wait for them, so each sees the new values.
    host, nvme, io = _pair(tmp_path, buffer_count=4)
    for k in range(2):
        _feed(host, k)
        host.step(1.0)
    _feed(nvme, 0)
    io.inject_delay(True, 0.05, count=1000)
    nvme.step(1.0)
    assert nvme.ring.pending() > 0  # the step left writes in flight
    _feed(nvme, 1)  # early reads of every sub-group while its write is pending
    nvme.step(1.0)
    assert nvme.master_in_memory  # fp32: the master is the host copy; the files' moments are what a save reads
    pieces = nvme.checkpoint_pieces(0)
    assert torch.equal(torch.cat([t.clone() for t in pieces["exp_avg"].pieces()]), host.shard_state(0)["exp_avg"])
    nvme.flush()
    assert nvme.ring.pending() == 0
    for sg, path, pad in zip(nvme.sub_groups, nvme.paths, nvme._pad):
        with open(path, "rb") as f:
            f.seek(pad * 4)  # segment 1: exp_avg
            on_disk = torch.frombuffer(bytearray(f.read(sg.numel * 4)), dtype=torch.float32)
        assert torch.equal(on_disk, host.shard_state(sg.shard)["exp_avg"][sg.start : sg.end]), path
    _same(host, nvme)
    nvme.close()


def test_state_load_round_trip(tmp_path):
    host, nvme, _ = _pair(tmp_path)
    _feed(host, 0)
    host.step(1.0)
    for s in range(len(SIZES)):
        nvme.load_master_shard(s, host.master_shard(s))
        nvme.load_shard_state(s, host.shard_state(s))
    _feed(host, 1)
    _feed(nvme, 1)
    host.step(1.0)
    nvme.step(1.0)
    for s in range(len(SIZES)):
        assert torch.equal(nvme.master_shard(s), host.master_shard(s))
    nvme.close()


CRASH = """
import os, sys
from zero_offload.swap_folder import SwapFolder
folder = SwapFolder(sys.argv[1], 0, 1)
with open(folder.file("group0.sg0.swp"), "wb") as f:
    f.write(b"crashed run")
print(folder.path, flush=True)
if sys.argv[2] == "crash":
    os._exit(1)  # killed: no finalizer runs, the folder and its files stay
sys.stdin.read()  # alive until the test closes our stdin
"""


def test_swap_folder_is_owned_cleared_and_removed(tmp_path):
    stranger = tmp_path / "theirs.txt"
    stranger.write_text("not zero's")
    _, nvme, _ = _pair(tmp_path)
    files = sorted(os.listdir(nvme.folder.path))
    assert files == sorted([".zero-swap-owner.json"] + [f"group{s.shard}.sg{s.index}.swp" for s in nvme.sub_groups])
    # a second engine of the same rank in this process gets its own folder: the first one's files are untouched
    again = SwapFolder(str(tmp_path), rank=0, bytes_needed=1)
    assert again.path.name == "rank0.1" and os.listdir(again.path) == [".zero-swap-owner.json"]
    again.close()
    assert sorted(os.listdir(nvme.folder.path)) == files
    nvme.close()
    assert not (tmp_path / "zero_swap").exists() and stranger.read_text() == "not zero's"
    # a start over a crashed run's folder clears its files and reuses the folder
    subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), "crash"], check=False, timeout=120)
    assert (
        os.listdir(tmp_path / "zero_swap" / "rank0") and (tmp_path / "zero_swap" / "rank0" / "group0.sg0.swp").exists()
    )
    reused = SwapFolder(str(tmp_path), rank=0, bytes_needed=1)
    assert reused.path.name == "rank0" and os.listdir(reused.path) == [".zero-swap-owner.json"]
    reused.close()
    assert not (tmp_path / "zero_swap").exists() and stranger.read_text() == "not zero's"


def test_swap_folder_of_a_live_process_is_left_alone(tmp_path):
    # two jobs of the same rank sharing nvme_path: the second must neither clear nor share the first one's files
    other = subprocess.Popen([sys.executable, "-c", CRASH, str(tmp_path), "live"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        theirs = other.stdout.readline().strip()
        mine = SwapFolder(str(tmp_path), rank=0, bytes_needed=1)
        assert mine.path.name == "rank0.1" and theirs.endswith("rank0")
        with open(os.path.join(theirs, "group0.sg0.swp"), "rb") as f:
            assert f.read() == b"crashed run"
        from zero_offload.swap_folder import reusable_bytes

        assert reusable_bytes(str(tmp_path)) == 0  # a live job's files are not room a new start may take
        mine.close()
    finally:
        other.stdin.close()
        other.wait(timeout=120)
    assert not (tmp_path / "zero_swap").exists()  # the other job closed cleanly on exit


def test_start_up_checks_name_the_key_and_bytes(tmp_path):
    with pytest.raises(SwapFolderError, match="nvme_path='.*missing' does not exist"):
        SwapFolder(str(tmp_path / "missing"), 0, 1)
    with pytest.raises(SwapFolderError, match=r"has \d+ bytes free; the swap files of rank 0 need 1000000000000000"):
        SwapFolder(str(tmp_path), 0, 10**15)
    (tmp_path / "zero_swap" / "rank0").mkdir(parents=True)
    (tmp_path / "zero_swap" / "rank0" / "data").write_text("x")
    with pytest.raises(SwapFolderError, match="not created by zero"):
        SwapFolder(str(tmp_path), 0, 1)
    assert (tmp_path / "zero_swap" / "rank0" / "data").read_text() == "x"
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # root can write anywhere: nothing to check then
            with pytest.raises(SwapFolderError, match="not writable"):
                SwapFolder(str(ro), 0, 1)
    finally:
        ro.chmod(0o700)


def test_enospc_during_step_is_named(tmp_path):
    host, nvme, io = _pair(tmp_path)
    _feed(nvme, 0)
    io.inject_error(True, errno.ENOSPC)
    with pytest.raises(AioError, match=r"write of '.*\.swp' at offset \d+, \d+ bytes failed: No space left"):
        nvme.step(1.0)


def test_failed_read_is_named_and_the_next_step_recovers(tmp_path):
    # a read that fails (EIO injected) fails the step before anything is stepped; the ring's room goes back, so
    # the retried step runs and equals one in-memory step
    host, nvme, io = _pair(tmp_path, buffer_count=4)
    io.inject_error(False, errno.EIO)
    _feed(nvme, 0)  # the reads start here
    with pytest.raises(AioError, match=r"read of '.*\.swp' at offset \d+, \d+ bytes failed: Input/output error"):
        nvme.step(1.0)
    _feed(host, 0)
    _feed(nvme, 0)
    host.step(1.0)
    nvme.step(1.0)
    _same(host, nvme)
    nvme.close()


def test_only_adam_on_nvme(tmp_path):
    folder = SwapFolder(str(tmp_path), 0, 1)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(4))], lr=0.1)
    with pytest.raises(ValueError, match="device='nvme' steps Adam/AdamW"):
        NVMeOptimizer([torch.zeros(4)], [0], sgd, folder=folder, io=AsyncIO())
    folder.close()
