"""Start-up checks of NVMe optimizer offload: buffers too small or too big for the largest sub-group, nvme_path
without room for the ranks of this machine; all before any rank builds its runtime, every rank raising the same."""

import os

import pytest
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_core import ZeroConfig
from zero_core.config import OffloadConfig
from zero_offload import master_store_for
from zero_offload.nvme_checks import NVMeConfigError, check_nvme, plan_nvme
from zero_offload.swap_folder import SwapFolder, SwapFolderError


def _section(path, **kw):
    return OffloadConfig(device="nvme", nvme_path=str(path), **kw)


def test_plan_counts_the_model():
    plan = plan_nvme(10_000_000, world=2, sub_group_size=1_000_000, buffer_count=4)
    assert plan.elements == 5_000_000 + 2048 and plan.largest_sub_group == 1_000_000
    assert plan.buffer_bytes == 4 * 3 * 1_000_448 * 4  # 3 page-padded fp32 segments per buffer
    assert plan.swap_bytes >= 12 * plan.elements  # master + two moments per element
    small = plan_nvme(1000, world=1, sub_group_size=1_000_000, buffer_count=4)
    assert small.largest_sub_group == 1000 + 1024  # a sub-group is never larger than the shard
    cut = plan_nvme(10_000_000, world=2, sub_group_size=10**9, buffer_count=4, largest_param=300_000)
    assert cut.largest_sub_group == 300_000  # nor than the largest parameter (sub-groups end at parameters)


def test_buffer_size_below_the_largest_sub_group_names_both_keys_and_the_size(tmp_path):
    plan = plan_nvme(100_000, world=1, sub_group_size=10_000, buffer_count=4)
    with pytest.raises(NVMeConfigError, match=r"offload_optimizer\.buffer_size=20000 elements is too small.*3 x "
                       r"10000 = 30000 elements.*sub_group_size=10000.*buffer_size >= 30000"):  # fmt: skip
        check_nvme(_section(tmp_path, buffer_size=20_000), 10_000, plan, 1, available=2**40)
    check_nvme(_section(tmp_path, buffer_size=30_000), 10_000, plan, 1, available=2**40)
    check_nvme(_section(tmp_path), 10_000, plan, 1, available=2**40)  # unset: buffers are sized to fit


def test_buffers_beyond_host_memory_name_buffer_count_and_sub_group_size(tmp_path, monkeypatch):
    plan = plan_nvme(10**9, world=1, sub_group_size=10**8, buffer_count=4)  # 4 x 1.2 GB (1e8 padded to 100000768)
    with pytest.raises(NVMeConfigError, match=r"buffer_count=4: 4 host buffers of 3 x 100000000 fp32 elements.*"
                       r"sub_group_size=100000000\) take 4800036864 bytes per rank, "
                       r"9600073728 for the 2 rank"):  # fmt: skip
        check_nvme(_section(tmp_path, buffer_count=4), 10**8, plan, 2, available=8 * 2**30)
    one = plan_nvme(10**9, 1, 10**8, 1)
    room = []  # the disk check is another test's; this one must not depend on the free space of tmp_path
    monkeypatch.setattr("zero_offload.nvme_checks.check_room", lambda path, need, **kw: room.append((path, need)))
    check_nvme(_section(tmp_path, buffer_count=1), 10**8, one, 2, available=8 * 2**30)  # 1.2 GB per rank fits
    assert room == [(str(tmp_path), 2 * one.swap_bytes)]  # then the room for both ranks' swap files is checked


def test_room_counts_every_rank_of_the_machine_and_prints_the_bytes(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    numel = free // 8  # one rank's share takes about half the free room: it fits, three ranks' do not
    plan = plan_nvme(numel, world=3, sub_group_size=10**8, buffer_count=1)
    assert plan.swap_bytes < free < 3 * plan.swap_bytes
    with pytest.raises(SwapFolderError, match=rf"has \d+ bytes free; the swap files of the 3 rank\(s\) on this "
                       rf"machine \({plan.swap_bytes} bytes each\) need {3 * plan.swap_bytes} bytes"):  # fmt: skip
        check_nvme(_section(tmp_path), 10**8, plan, 3, available=2**60)
    with pytest.raises(SwapFolderError, match="does not exist"):
        check_nvme(_section(tmp_path / "missing"), 10**8, plan_nvme(10, 1, 10, 1), 1, available=2**60)


CRASHED_RUN = """
import os, sys
from zero_offload.swap_folder import SwapFolder
old = SwapFolder(sys.argv[1], 0, 1)
with open(old.file("group0.sg0.swp"), "wb") as f:
    f.truncate(1 << 20)  # a 1 MiB swap file (sparse: takes no room, counted as reusable)
os._exit(1)  # the process dies: its folder and files stay
"""


def test_previous_run_files_count_as_room(tmp_path):
    import subprocess
    import sys

    from zero_offload.swap_folder import reusable_bytes

    subprocess.run([sys.executable, "-c", CRASHED_RUN, str(tmp_path)], check=False, timeout=120)
    assert reusable_bytes(str(tmp_path)) == 1 << 20
    SwapFolder(str(tmp_path), 0, 1).close()
    assert not (tmp_path / "zero_swap").exists()


def _build_on_ranks(nvme_root, bad_rank):
    model = nn.Linear(64, 64)
    path = nvme_root if dist.get_rank() != bad_rank else os.path.join(nvme_root, "missing")
    cfg = ZeroConfig.model_validate({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": path}})
    try:
        master_store_for(cfg, model, dist.get_world_size(), dist.get_rank())
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "built"


def test_one_rank_failing_the_check_fails_every_rank_before_work(tmp_path):
    got = run_ranks(_build_on_ranks, 2, str(tmp_path), 1, timeout=60, threads=1)
    for rank, message in enumerate(got):  # rank 0's own path is fine: it raises rank 1's error, never goes on alone
        assert "missing' does not exist" in message, (rank, message)
