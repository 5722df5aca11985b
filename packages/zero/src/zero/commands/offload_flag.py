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
        zo["offload_optimizer"] = {"device": "cpu", "pin_memory": "auto"}  # pinned where the machine can pin
    else:  # the config's own nvme keys (buffer_count, pipelining...) stay; the path: flag, config, run folder
        own = zo.get("offload_optimizer") or {}
        own = dict(own) if own.get("device") == "nvme" else {"pin_memory": "auto"}
        own.update(device="nvme", nvme_path=nvme_path or own.get("nvme_path") or str(run_dir))
        zo["offload_optimizer"] = own
        param = zo.get("offload_param") or {}
        if param.get("device") == "nvme" and nvme_path:  # the config's parameter swap files follow the flag too
            zo["offload_param"] = {**param, "nvme_path": nvme_path}
    return config


def check_nvme_before_launch(engine_config, model_size: str, seq_len: int, nproc: int, run_dir: pathlib.Path) -> str:
    """``--offload nvme`` (or a config with ``offload_optimizer.device: nvme``): zero_offload's start-up checks
    (``nvme_path`` exists, is writable and has room for the swap files of the ``nproc`` ranks; buffers fit the host
    memory) computed from the model size, before any rank starts. The default ``nvme_path`` is the run folder, not
    created yet: its nearest existing parent is checked then. Returns a line stating the bytes ("" without nvme).

    Raises:
        zero_offload.swap_folder.SwapFolderError, zero_offload.nvme_checks.NVMeConfigError: as the ranks would.
    """
    section = engine_config.zero_optimization.offload_optimizer
    if section is None or section.device != "nvme":
        return ""
    import torch

    from zero.train.model import llama_config
    from zero_offload.nvme_checks import check_nvme, plan_nvme, streams_gradients

    with torch.device("meta"):  # counts only: no memory
        from transformers import LlamaForCausalLM

        numels = [p.numel() for p in LlamaForCausalLM(llama_config(model_size, seq_len)).parameters()]
    zo = engine_config.zero_optimization
    plan = plan_nvme(sum(numels), nproc, zo.sub_group_size, section.buffer_count, max(numels),
                     stream_grads=streams_gradients(zo))  # fmt: skip
    path = pathlib.Path(section.nvme_path)
    if path.resolve() == run_dir.resolve():
        while not path.exists() and path != path.parent:
            path = path.parent
    check_nvme(section.model_copy(update={"nvme_path": str(path)}), zo.sub_group_size, plan, nproc)
    return (f"optimizer state on NVMe: {plan.swap_bytes * nproc} bytes of swap files ({nproc} ranks) under "
            f"{section.nvme_path}, {plan.buffer_bytes} bytes of host buffers per rank")  # fmt: skip
