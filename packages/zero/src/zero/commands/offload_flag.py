"""``zero train --offload {none,cpu,nvme}``: put the optimizer state in host memory or on NVMe for the run."""

from __future__ import annotations

import pathlib

CHOICES = ("none", "cpu", "nvme")


def add_offload_arguments(parser) -> None:
    """``--offload`` and ``--nvme-path``."""
    parser.add_argument("--offload", choices=CHOICES, default=None, help="optimizer state: none (on the device), "
                        "cpu (host memory, CPU Adam) or nvme (swap files); default: as the config says")  # fmt: skip
    parser.add_argument("--nvme-path", default=None, help="folder for --offload nvme swap files (default: the run "
                        "folder; zero creates zero_swap/ inside and removes it at the end)")  # fmt: skip


def apply_offload(config: dict, offload: str | None, nvme_path: str | None, run_dir: pathlib.Path) -> dict:
    """``config`` with ``zero_optimization.offload_optimizer`` set for ``offload`` (unchanged for None).

    Raises:
        ValueError: ``--nvme-path`` without ``--offload nvme``.
    """
    if nvme_path and offload != "nvme":
        raise ValueError("--nvme-path needs --offload nvme")
    if offload is None:
        return config
    zo = config.setdefault("zero_optimization", {})
    if offload == "none":
        zo.pop("offload_optimizer", None)
    elif offload == "cpu":
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    else:
        zo["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path or str(run_dir), "pin_memory": True}
    return config
