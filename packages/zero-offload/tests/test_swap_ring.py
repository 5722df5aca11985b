"""SwapRing: room handed out in ring order, never reused before its I/O has landed, reads after their sub-group's
pending write, named errors."""

import errno

import pytest
import torch

from zero_kernels.aio import AioError, AioSettings, AsyncIO
from zero_offload.swap_ring import SwapRing

N = 1024  # elements of one region (4 KiB: one O_DIRECT page)


def _ring(tmp_path, regions=3):
    io = AsyncIO(AioSettings(block_size=4096, queue_depth=2), str(tmp_path))
    return SwapRing(regions * N, io), io


def test_regions_follow_in_ring_order_and_wrap(tmp_path):
    ring, _ = _ring(tmp_path)
    a, b = ring.place(0, N), ring.place(1, 2 * N)
    assert (a.start, b.start) == (0, N)
    assert ring.place(2, N) is None  # wraps to 0, where region a's data has not been used
    ring.release(a)
    c = ring.place(2, N)
    assert c.start == 0 and ring.place(3, N) is None  # b still holds unused data
    with pytest.raises(ValueError, match="cannot hold a sub-group region of 3073"):
        ring.place(4, 3 * N + 1)


def test_room_is_reused_only_after_its_write_landed(tmp_path):
    ring, io = _ring(tmp_path, regions=1)
    path = str(tmp_path / "sg0.swp")
    a = ring.place(0, N)
    ring.view(a).fill_(1.0)
    io.inject_delay(True, 0.2)  # a slow write: reusing its room early would write the 2.0s below
    ring.write(a, N, path, 0)
    b = ring.place(1, N)  # same room: waits for the write
    assert b.start == 0 and a.handle is None
    ring.view(b).fill_(2.0)
    with open(path, "rb") as f:
        assert torch.equal(torch.frombuffer(bytearray(f.read(4 * N)), dtype=torch.float32), torch.ones(N))


def test_read_waits_for_the_pending_write_of_its_sub_group(tmp_path):
    ring, io = _ring(tmp_path)
    path = str(tmp_path / "sg0.swp")
    a = ring.place(0, N)
    ring.view(a).copy_(torch.arange(N, dtype=torch.float32))
    io.inject_delay(True, 0.2)
    ring.write(a, N, path, 0)
    b = ring.place(0, N)  # other room, same sub-group: its file is still being written
    assert b.start == N
    ring.read(b, path, 0)
    ring.settle(b)
    assert torch.equal(ring.view(b), torch.arange(N, dtype=torch.float32))
    assert ring.pending() == 0


def test_drain_waits_for_all_and_raises_the_write_error(tmp_path):
    ring, io = _ring(tmp_path)
    io.inject_error(True, errno.ENOSPC)
    for k in range(2):
        r = ring.place(k, N)
        ring.view(r).zero_()
        ring.write(r, N, str(tmp_path / f"sg{k}.swp"), 0)
    with pytest.raises(AioError, match=r"write of '.*sg0\.swp' at offset 0, 4096 bytes failed: No space left"):
        ring.drain()
    assert ring.pending() == 0 and ring.place(0, 3 * N).start == 0  # every region forgotten: the ring is free


def test_a_second_write_of_a_sub_group_waits_for_the_first(tmp_path):
    ring, io = _ring(tmp_path)
    path = str(tmp_path / "sg0.swp")
    a, b = ring.place(0, N), ring.place(0, N)
    ring.view(a).fill_(1.0)
    ring.view(b).fill_(2.0)
    io.inject_delay(True, 0.2)  # the first write is slow: both in flight could land in either order
    ring.write(a, N, path, 0)
    ring.write(b, N, path, 0)
    assert a.handle is None  # waited for before the second was submitted
    ring.drain()
    with open(path, "rb") as f:
        assert torch.equal(torch.frombuffer(bytearray(f.read(4 * N)), dtype=torch.float32), torch.full((N,), 2.0))
