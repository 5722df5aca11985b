"""launch_topology: rank, local rank, ranks per node and node count from torchrun's environment."""

import pytest

from zero_comm.topology import LaunchTopology, launch_topology


def test_from_torchrun_environment():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2"}  # fmt: skip
    assert launch_topology(env) == LaunchTopology(5, 8, 1, 4, 1, 2)
    # without GROUP_*: node rank and count from the ranks per node
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert launch_topology(env) == LaunchTopology(2, 4, 0, 2, 1, 2)
    assert launch_topology({}) == LaunchTopology(0, 1, 0, 1, 0, 1)  # no launcher: one node of one rank


@pytest.mark.parametrize(
    "env, expected",
    [({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
     ({"RANK": "4", "WORLD_SIZE": "4"}, "inconsistent launch environment: RANK=4 WORLD_SIZE=4"),
     ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8")],
)  # fmt: skip
def test_bad_environment_names_the_variable(env, expected):
    with pytest.raises(ValueError, match=expected):
        launch_topology(env)
