"""The (dp, sp, tp) mesh and DeepSpeed's mpu methods: ranks and group members for world 4 = dp 2 x sp 2 and
world 2 = sp 2, and the errors for sizes that cannot be laid out."""

import pytest
import torch.distributed as dist

from zero_comm.testing import run_ranks
from zero_parallel import SequenceParallelMPU, init_parallel_mesh


def _members(group) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _layout(sp: int) -> dict:
    mpu = SequenceParallelMPU.build(sp)
    return {
        "sp": (mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size(),
               _members(mpu.get_sequence_parallel_group())),
        "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
               _members(mpu.get_data_parallel_group())),
        "sdp": (mpu.get_sequence_data_parallel_rank(), mpu.get_sequence_data_parallel_world_size(),
                _members(mpu.get_sequence_data_parallel_group())),
        "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
               _members(mpu.get_model_parallel_group())),
        "mesh": tuple(mpu.mesh.shape),
    }  # fmt: skip


def test_world_4_is_dp_2_by_sp_2():
    got = run_ranks(_layout, 4, 2, timeout=60)
    for rank, layout in enumerate(got):
        dp_rank, sp_rank = divmod(rank, 2)
        assert layout["sp"] == (sp_rank, 2, [2 * dp_rank, 2 * dp_rank + 1])  # consecutive ranks share a sequence
        assert layout["dp"] == (dp_rank, 2, [sp_rank, sp_rank + 2])
        assert layout["sdp"] == (rank, 4, [0, 1, 2, 3])
        assert layout["mp"] == (0, 1, [rank])
        assert layout["mesh"] == (2, 2, 1)


def test_world_2_is_sp_2():
    got = run_ranks(_layout, 2, 2, timeout=60)
    for rank, layout in enumerate(got):
        assert layout["sp"] == (rank, 2, [0, 1])
        assert layout["dp"] == (0, 1, [rank])
        assert layout["sdp"] == (rank, 2, [0, 1])
        assert layout["mp"] == (0, 1, [rank])


def _build_error(sp) -> str:
    try:
        init_parallel_mesh(sp)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(
    "sp, expected",
    [(3, "ValueError: sequence_parallel_size=3 does not divide the world size 4"),
     (0, "ValueError: sequence_parallel_size must be >= 1, got 0"),
     (-2, "ValueError: sequence_parallel_size must be >= 1, got -2"),
     (2.0, "TypeError: sequence_parallel_size must be an int >= 1, got float 2.0")],
)  # fmt: skip
def test_sizes_that_cannot_be_laid_out_are_named(sp, expected):
    assert all(msg.startswith(expected) for msg in run_ranks(_build_error, 4, sp, timeout=60))


def test_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        init_parallel_mesh(1)
