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
    assert got == {"device": "nvme", "nvme_path": str(run), "pin_memory": "auto"}


def test_offload_flag_pins_only_where_the_machine_can():
    """The flag asks for ``"auto"``: pinned with an accelerator, pageable (and no fallback warning) without one."""
    import warnings

    import torch

    from zero.config.model import load_config

    for offload in ("cpu", "nvme"):
        raw = apply_offload({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}, offload,
                            None, pathlib.Path("/tmp"))  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cfg = load_config(raw)
        assert cfg.zero_optimization.offload_optimizer.pin_memory is torch.cuda.is_available()
