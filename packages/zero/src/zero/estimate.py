"""Model-state memory estimates per device (ZeRO paper, arXiv 1910.02054, section 5.1), printed as DeepSpeed's
``estimate_zero{2,3}_model_states_mem_needs_all_live`` print them.

Memory model, per parameter element, for mixed-precision Adam training as zero lays it out: 2 bytes of 16-bit
parameter, 4 bytes of gradient (zero reduces and accumulates gradients in fp32: ``PrecisionPolicy.accum``), 4
bytes of fp32 master weight and 8 bytes of Adam state (momentum, variance): 18 bytes, the same total DeepSpeed
uses. Stage 2 keeps the 16-bit parameters whole on every device and partitions the other 16 bytes; stage 3
partitions all 18 and adds, per device, the largest layer gathered (16-bit parameter and gradient, 4 bytes).
With ``offload_optimizer`` the master weights and Adam state (12 bytes) live in host memory instead, multiplied
by ``additional_buffer_factor`` for pinned staging buffers, as DeepSpeed assumes.
"""

from __future__ import annotations

import torch

PARAM_BYTES, GRAD_BYTES, MASTER_BYTES, ADAM_BYTES = 2, 4, 4, 8


def model_to_params(model: torch.nn.Module) -> tuple[int, int]:
    """``(total_params, largest_layer_params)``: distinct parameter elements (tied counted once) and the most
    elements held directly by one module."""
    seen, total, largest = set(), 0, 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    for m in model.modules():
        largest = max(largest, sum(p.numel() for p in m.parameters(recurse=False)))
    return total, largest


def zero_model_states_bytes(
    stage: int,
    total_params: int,
    largest_layer_params: int,
    devices: int,
    devices_per_node: int,
    offload_optimizer: bool,
    additional_buffer_factor: float = 1.5,
) -> tuple[int, int]:
    """``(host bytes per node, device bytes per device)`` for ``stage`` 2 or 3 (see the module docstring)."""
    sharded = GRAD_BYTES + (0 if offload_optimizer else MASTER_BYTES + ADAM_BYTES)
    if stage == 2:
        device = PARAM_BYTES * total_params + sharded * total_params / devices
    else:
        device = (PARAM_BYTES + sharded) * total_params / devices + 4 * largest_layer_params
    host_state = (MASTER_BYTES + ADAM_BYTES) * total_params / devices * devices_per_node if offload_optimizer else 0
    host = (host_state + PARAM_BYTES * total_params) * additional_buffer_factor  # plus the model built on the host
    return int(host), int(device)


def _print_table(
    stage: int, model: torch.nn.Module, num_gpus_per_node: int, num_nodes: int, additional_buffer_factor: float
) -> list[tuple[float, float, str]]:
    total, largest = model_to_params(model)
    devices = num_nodes * num_gpus_per_node
    rows = []
    for offload in (True, False):
        host, device = zero_model_states_bytes(
            stage, total, largest, devices, num_gpus_per_node, offload, additional_buffer_factor
        )
        rows.append((host / 2**30, device / 2**30, f"offload_optimizer={'cpu ' if offload else 'none'}"))
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} node{'s' if num_nodes > 1 else ''}, {num_gpus_per_node} "
        f"GPU{'s' if num_gpus_per_node > 1 else ''} per node.\n"
        f"SW: Model with {total / 1e6:.0f}M total params"
        + (f", {largest / 1e6:.0f}M largest layer params." if stage == 3 else ".")
    )
    print("  per CPU  |  per GPU |   Options")
    for host_gb, device_gb, options in rows:
        print(f" {host_gb:7.2f}GB | {device_gb:6.2f}GB | {options}")
    return rows


def estimate_zero2_model_states_mem_needs_all_live(
    model: torch.nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
):
    """Print the ZeRO-2 model-state memory per CPU node and per GPU for ``model`` (DeepSpeed's signature).

    Returns the printed rows ``[(GiB per CPU node, GiB per GPU, options), ...]`` (DeepSpeed returns None)."""
    return _print_table(2, model, num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_live(
    model: torch.nn.Module, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
):
    """Print the ZeRO-3 model-state memory per CPU node and per GPU for ``model`` (DeepSpeed's signature).

    Returns the printed rows ``[(GiB per CPU node, GiB per GPU, options), ...]`` (DeepSpeed returns None)."""
    return _print_table(3, model, num_gpus_per_node, num_nodes, additional_buffer_factor)
