"""1-bit compressed all-reduce (zero_comm.compressed) on 2 and 3 gloo ranks.

References: an in-process emulation of the same two rounds (worker compress, all-to-all, server average and
compress, all-gather) computed from every rank's input, tolerance 1e-6 (only the order of fp32 sums differs);
error feedback checked by its defining property: over T calls with the same input the mean output tends to the
true average, the gap bounded by the last errors' size over T. Bytes on the wire from the CommsLogger against the
formula (1 bit per element plus one fp32 scale per rank per round).
"""

import pytest
import torch
import torch.distributed as dist

from zero_comm import CommsLogger, compressed_all_reduce, compressed_numel, compressed_wire_bytes
from zero_comm.compressed import pack_signs, unpack_signs
from zero_comm.testing import run_ranks

NUMEL = 1001  # divisible by no 8 * world: padding is exercised


def _inputs(world: int, call: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + call)
    return [torch.randn(NUMEL, generator=g) * (r + 1) for r in range(world)]


def _compress(x):
    scale = x.norm() / x.numel() ** 0.5
    signs = torch.where(x >= 0, 1.0, -1.0)
    return scale * signs, x - scale * signs


def _emulate(inputs, worker_err, server_err):
    """One call on every rank, in one process; updates the error lists in place; returns the common output."""
    world = len(inputs)
    padded = compressed_numel(NUMEL, world)
    chunk = padded // world
    sent = []
    for r, x in enumerate(inputs):
        buf = torch.zeros(padded)
        buf[:NUMEL] = x
        buf += worker_err[r]
        q, worker_err[r] = _compress(buf)
        sent.append(q.view(world, chunk))
    out = []
    for j in range(world):
        avg = torch.stack([sent[r][j] for r in range(world)]).mean(0) + server_err[j]
        q, server_err[j] = _compress(avg)
        out.append(q)
    return torch.cat(out)[:NUMEL]


def _body(calls: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    padded = compressed_numel(NUMEL, world)
    werr, serr = torch.zeros(padded), torch.zeros(padded // world)
    outs = []
    with CommsLogger() as log:
        for c in range(calls):
            outs.append(compressed_all_reduce(_inputs(world, c)[rank], werr, serr, group))
    wire = sum(r.wire_bytes for r in log.records)
    return outs, [r.name for r in log.records], wire


@pytest.mark.parametrize("world", [2, 3])
def test_matches_emulation_and_is_identical_on_every_rank(world):
    calls = 4
    results = run_ranks(_body, world, calls, timeout=60)
    padded = compressed_numel(NUMEL, world)
    werr, serr = [torch.zeros(padded)] * world, [torch.zeros(padded // world)] * world
    for c in range(calls):
        ref = _emulate(_inputs(world, c), werr, serr)
        for rank, (outs, _, _) in enumerate(results):
            torch.testing.assert_close(outs[c], ref, rtol=1e-5, atol=1e-6, msg=f"call {c} rank {rank}")
            assert torch.equal(outs[c], results[0][0][c]), f"call {c}: rank {rank} differs from rank 0"


def test_wire_bytes_are_one_bit_per_element_plus_scales():
    world, calls = 2, 3
    results = run_ranks(_body, world, calls, timeout=60)
    outs, names, wire = results[0]
    assert names == ["onebit_all_to_all", "onebit_all_gather"] * calls
    padded = compressed_numel(NUMEL, world)
    # per call: two rounds, each sends (w-1)/w of w pieces of (padded/w/8 bytes of signs + 4 bytes of scale)
    expected = calls * 2 * (world - 1) * (padded // world // 8 + 4)
    assert wire == expected == calls * compressed_wire_bytes(NUMEL, world)
    fp32_all_reduce = calls * 2 * (world - 1) / world * 4 * NUMEL
    assert fp32_all_reduce / wire > 25  # 32x less the scales and the padding of 1001 to 1008


def test_error_feedback_makes_the_running_mean_exact():
    """sum of T outputs = T * avg + (initial - final errors): the errors stay bounded (measured: they saturate at
    ~2.5x the input's norm), so the running mean's gap to the average falls like 1/T (x4 from T=40 to 160 in
    theory, measured x4.2; bound x2.5)."""
    world, calls = 2, 160
    results = run_ranks(_body_constant, world, calls, timeout=60)
    true_avg = torch.stack(_inputs(world, 0)).mean(0)
    outs = torch.stack(results[0])
    gap = {t: float((outs[:t].mean(0) - true_avg).norm()) for t in (1, 40, 160)}
    assert gap[40] < gap[1] / 5 and gap[160] < gap[40] / 2.5, gap
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1])), "ranks differ"


def _body_constant(calls: int):
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = compressed_numel(NUMEL, world)
    werr, serr = torch.zeros(padded), torch.zeros(padded // world)
    x = _inputs(world, 0)[rank]
    return [compressed_all_reduce(x, werr, serr, dist.group.WORLD) for _ in range(calls)]


def test_pack_round_trip_and_sign_of_zero():
    x = torch.tensor([0.0, -1.0, 2.0, -0.0, 3.0, -4.0, 5.0, -6.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 2
    expected = torch.tensor([1, -1, 1, -1, 1, -1, 1, -1, 1, 1, 1, 1, -1, -1, -1, -1], dtype=torch.float32)  # -0 < 0
    assert torch.equal(unpack_signs(packed), expected)


def _bad_buffer():
    padded = compressed_numel(NUMEL, dist.get_world_size())
    try:
        compressed_all_reduce(torch.zeros(NUMEL), torch.zeros(padded - 8), torch.zeros(1), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return None


def test_wrong_error_buffer_is_named_before_sending():
    msg = run_ranks(_bad_buffer, 1, timeout=30)[0]
    assert "worker_error" in msg and f"{compressed_numel(NUMEL, 1)} fp32 elements" in msg, msg
