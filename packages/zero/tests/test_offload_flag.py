"""``zero train --offload``: the config's own nvme keys survive the flag; the swap path comes from the flag, then
the config, then the run folder."""

import pathlib

from zero.commands.offload_flag import apply_offload


def test_nvme_flag_keeps_the_configs_nvme_keys_and_path():
    run = pathlib.Path("/runs/r")
    own = {"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/disk", "buffer_count": 2}}}
    got = apply_offload(own, "nvme", None, run)["zero_optimization"]["offload_optimizer"]
    assert got == {"device": "nvme", "nvme_path": "/disk", "buffer_count": 2}
    flag = apply_offload({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/disk"}}},
                         "nvme", "/fast", run)  # fmt: skip
    assert flag["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/fast"
    was_cpu = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
    got = apply_offload(was_cpu, "nvme", None, run)["zero_optimization"]["offload_optimizer"]
    assert got == {"device": "nvme", "nvme_path": str(run), "pin_memory": True}
