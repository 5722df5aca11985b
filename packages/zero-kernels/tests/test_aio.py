"""The async I/O engine: round trips at offsets, O_DIRECT and its fallback, errors that name file/offset/size."""

import errno
import os
import time
import warnings

import pytest
import torch

from zero_kernels.aio import AioError, AioSettings, AsyncIO, aligned_empty, supports_direct

BACKENDS = [None, False]  # the C++ op (when it builds) and the Python thread pool


@pytest.fixture(params=BACKENDS, ids=["op", "python"])
def use_op(request):
    return request.param


def test_aligned_empty_is_aligned_and_padded():
    t = aligned_empty(1000, torch.float32)
    assert t.numel() == 1000 and t.data_ptr() % 4096 == 0
    assert t.untyped_storage().nbytes() >= 4096  # padded to whole pages


def test_large_aligned_empty_is_a_huge_page_mapping_of_its_own(tmp_path, use_op):
    from zero_kernels.aio import HUGE_PAGE, HUGE_PAGE_MIN_BYTES

    n = HUGE_PAGE_MIN_BYTES // 2 + 1000  # bf16: just past the threshold once padded
    t = aligned_empty(n, torch.bfloat16)
    assert t.numel() == n and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0  # 2 MiB aligned: every whole huge page of it can be a huge page
    assert t.untyped_storage().nbytes() >= HUGE_PAGE_MIN_BYTES
    small = aligned_empty(HUGE_PAGE_MIN_BYTES // 4 - 1024)  # just under: the ordinary 4096-aligned buffer
    assert small.data_ptr() % 4096 == 0
    # an O_DIRECT round trip from and into such buffers, two of them alive at once
    io = AsyncIO(AioSettings(block_size=1 << 20, queue_depth=4), str(tmp_path), use_op=use_op)
    t.copy_(torch.arange(n, dtype=torch.float32).remainder(251).to(torch.bfloat16))
    io.wait(io.write(t, str(tmp_path / "big.bin")))
    back = aligned_empty(n, torch.bfloat16)
    io.wait(io.read(back, str(tmp_path / "big.bin")))
    assert torch.equal(back, t)
    io.close()


def test_round_trip_at_offsets(tmp_path, use_op):
    io = AsyncIO(AioSettings(block_size=8192, queue_depth=4), str(tmp_path), use_op=use_op)
    a = aligned_empty(300_000).normal_()
    b = torch.randn(777)  # unaligned size and (usually) address: goes through the page cache
    path = str(tmp_path / "swap.bin")
    h1, h2 = io.write(a, path, 0), io.write(b, path, 2_400_256)
    io.wait(h1)
    io.wait(h2)
    ra, rb = aligned_empty(300_000), torch.empty(777)
    io.wait(io.read(ra, path, 0))
    io.wait(io.read(rb, path, 2_400_256))
    assert torch.equal(ra, a) and torch.equal(rb, b)
    assert (io.reads, io.writes) == (2, 2) and io.bytes_written == a.numel() * 4 + b.numel() * 4
    io.close()


def test_short_read_is_an_error_not_zeros(tmp_path, use_op):
    io = AsyncIO(AioSettings(block_size=4096), str(tmp_path), use_op=use_op)
    path = str(tmp_path / "small.bin")
    io.wait(io.write(torch.ones(1024), path))  # 4096 bytes
    with pytest.raises(AioError, match=r"small\.bin' at offset 4096, 4096 bytes failed: short read"):
        io.wait(io.read(torch.empty(2048), path))


def test_injected_enospc_names_file_offset_size(tmp_path, use_op):
    io = AsyncIO(AioSettings(block_size=4096, queue_depth=1), str(tmp_path), use_op=use_op)
    io.inject_error(True, errno.ENOSPC)
    with pytest.raises(AioError, match=r"write of '.*full\.bin' at offset 0, 4096 bytes failed: No space left"):
        io.wait(io.write(torch.ones(4096), str(tmp_path / "full.bin")))


def test_injected_delay_holds_the_write_until_it_lands(tmp_path, use_op):
    io = AsyncIO(AioSettings(block_size=4096, queue_depth=1), str(tmp_path), use_op=use_op)
    path = tmp_path / "slow.bin"
    io.inject_delay(True, 2.0)  # a slow disk: the first chunk of the next write sleeps 2 s before its pwrite
    h = io.write(aligned_empty(2048).fill_(7.0), str(path))
    early = path.read_bytes() if path.exists() else b""
    assert early.count(0) == len(early)  # nothing written yet (the op reserves the blocks: zeros)
    io.wait(h)
    assert torch.equal(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32), torch.full((2048,), 7.0))
    io.close()


def test_missing_file_read_fails_at_submit(tmp_path, use_op):
    io = AsyncIO(folder=str(tmp_path), use_op=use_op)
    with pytest.raises(AioError, match="nope.bin"):
        io.read(torch.empty(4), str(tmp_path / "nope.bin"))


def test_no_o_direct_warns_once_and_works(tmp_path, monkeypatch, use_op):
    import zero_kernels.aio as aio

    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and not supports_direct(shm):
        folder = shm  # a real tmpfs
    else:  # no tmpfs here: make the probe answer as tmpfs would
        folder = str(tmp_path)
        monkeypatch.setattr(aio, "supports_direct", lambda _: False)
    aio._warned_dirs.discard(folder)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        io = AsyncIO(AioSettings(), folder, use_op=use_op)
        AsyncIO(AioSettings(), folder, use_op=use_op)
    assert not io.direct
    assert sum("does not support O_DIRECT" in str(x.message) and folder in str(x.message) for x in w) == 1
    path = os.path.join(folder, f"zero_aio_test_{os.getpid()}.bin")
    try:
        t = aligned_empty(5000).normal_()
        io.wait(io.write(t, path))
        back = aligned_empty(5000)
        io.wait(io.read(back, path))
        assert torch.equal(back, t)
    finally:
        os.unlink(path)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="aio.block_size"):
        AsyncIO(AioSettings(block_size=1000))
    with pytest.raises(ValueError, match="aio.queue_depth"):
        AsyncIO(AioSettings(queue_depth=0))


def test_failed_request_finishes_every_chunk_before_wait_raises(tmp_path, use_op):
    # chunk 0 fails at once, chunks 1-3 would land 0.3 s later: wait must not return (and close the file) before
    # them, or their writes go through a recycled descriptor into whatever file is opened next
    io = AsyncIO(AioSettings(block_size=4096, queue_depth=2), str(tmp_path), use_op=use_op)
    io.inject_error(True, errno.ENOSPC, 1)
    io.inject_delay(True, 0.3, 3)
    with pytest.raises(AioError, match="No space left"):
        io.wait(io.write(aligned_empty(4096).fill_(1.0), str(tmp_path / "full.bin")))
    other = tmp_path / "other.bin"
    fd = os.open(other, os.O_RDWR | os.O_CREAT, 0o644)  # likely reuses the descriptor number just closed
    try:
        time.sleep(0.6)  # 2x the injected delay: a stray chunk would have written by now
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    io.close()


@pytest.mark.parametrize("single_submit,overlap_events", [(False, True), (True, False)])
def test_kernel_aio_and_thread_pool_engines_round_trip(tmp_path, single_submit, overlap_events):
    # the op's two engines (kernel AIO submitters, synchronous thread pool) under the aio keys that change
    # kernel AIO's submission; 40 chunks through queue depth 3 and 2 threads, aligned and unaligned
    a = aligned_empty(40 * 1024).normal_()
    b = torch.randn(999)
    for engine in ("kernel_aio", "threads"):
        s = AioSettings(block_size=4096, queue_depth=3, thread_count=2, single_submit=single_submit,
                        overlap_events=overlap_events, engine=engine)  # fmt: skip
        io = AsyncIO(s, str(tmp_path), use_op=True)
        assert io.engine == engine or io.fallback_reason  # kernel AIO may be refused (seccomp): then it says why
        path = str(tmp_path / f"{engine}.bin")
        io.write(a, path, 8192)
        io.write(b, path, 8192 + a.numel() * 4 + 4)  # unaligned offset and size: through the page cache
        io.wait_all()
        ra, rb = aligned_empty(a.numel()), torch.empty(b.numel())
        io.read(ra, path, 8192)
        io.read(rb, path, 8192 + a.numel() * 4 + 4)
        io.wait_all()
        assert torch.equal(ra, a) and torch.equal(rb, b)
        io.close()
