"""Checkpoints of :class:`~zero.optim.onebit.CompressedRuntime` (stage 0: every rank holds the whole model).

Layout under ``save_dir/tag``: ``model.safetensors`` (rank 0: the module's ``state_dict``),
``optim_rank<r>.safetensors`` (each rank: its optimizer's per-tensor state, keys ``<param index>.<name>``) and
``meta.json`` (rank 0: the optimizer's counters, ``client_state``, the engine's state); ``save_dir/latest`` holds
the tag. Files are written to a temporary name and renamed. Nothing is unpickled on load. As DeepSpeed's 1-bit
optimizers do, the compression error buffers are not saved: they restart at zero after a load (DeepSpeed verified
that this does not hurt convergence on BERT).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

ERRORS = ("worker_error", "server_error")
COUNTERS = ("steps", "var_interval", "var_counter", "local_step_interval", "local_step_counter", "frozen")


def _atomic_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def save(runtime, save_dir: str, tag: str, client_state: dict, engine_state: dict) -> None:
    """Collective. Raises TypeError naming ``client_state`` when it does not serialise to JSON."""
    from safetensors.torch import save_file

    path = os.path.join(save_dir, tag)
    os.makedirs(path, exist_ok=True)
    opt, rank = runtime.optimizer, runtime.rank
    index = {id(p): i for i, p in enumerate(runtime.params)}
    tensors, scalars = {}, {}
    for p, st in opt.state.items():
        for k, v in st.items():
            if k in ERRORS:
                continue
            if isinstance(v, torch.Tensor):
                tensors[f"{index[id(p)]}.{k}"] = v.detach().contiguous()
            else:
                scalars[f"{index[id(p)]}.{k}"] = v
    save_file(tensors, os.path.join(path, f"optim_rank{rank}.safetensors.tmp"))
    os.replace(
        os.path.join(path, f"optim_rank{rank}.safetensors.tmp"), os.path.join(path, f"optim_rank{rank}.safetensors")
    )
    if rank == 0:
        state = {k: v.detach().contiguous() for k, v in runtime.module.state_dict().items()}
        save_file(state, os.path.join(path, "model.safetensors.tmp"))
        os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
        counters = {k: getattr(opt, k) for k in COUNTERS if hasattr(opt, k)}
        try:
            meta = {"optimizer": counters, "state_scalars": scalars, "client_state": client_state,
                    "engine_state": engine_state, "world_size": runtime.world}  # fmt: skip
            _atomic_json(os.path.join(path, "meta.json"), meta)
        except TypeError as e:
            raise TypeError(f"save_checkpoint: client_state must be JSON-serialisable here: {e}") from None
        with open(os.path.join(save_dir, "latest.tmp"), "w") as f:
            f.write(tag)
        os.replace(os.path.join(save_dir, "latest.tmp"), os.path.join(save_dir, "latest"))
    if runtime.world > 1:
        dist.barrier(runtime.group)


def load(runtime, load_dir: str, tag: str | None, load_optimizer_states: bool) -> tuple[str, dict, dict]:
    """Returns ``(path, client_state, engine_state)``, ``path`` the model file read
    (``load_dir/tag/model.safetensors``, as DeepSpeed's ``load_checkpoint`` names its model-states file). Raises
    FileNotFoundError naming the missing file, or ValueError when the world size differs (each rank's optimizer file
    belongs to its rank)."""
    from safetensors.torch import load_file

    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"load_checkpoint: {latest} not found (give a tag)")
        tag = open(latest).read().strip()
    path = os.path.join(load_dir, tag)
    meta_path = os.path.join(path, "meta.json")
    for f in (meta_path, os.path.join(path, "model.safetensors")):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"load_checkpoint: {f} not found")
    meta = json.load(open(meta_path))
    if meta["world_size"] != runtime.world:
        raise ValueError(f"load_checkpoint: {path} was saved by {meta['world_size']} ranks, this run has "
                         f"{runtime.world}; 1-bit optimizer checkpoints do not reshard")  # fmt: skip
    runtime.module.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    if load_optimizer_states:
        opt = runtime.optimizer
        tensors = load_file(os.path.join(path, f"optim_rank{runtime.rank}.safetensors"))
        opt.state.clear()
        for key, v in list(tensors.items()) + list(meta["state_scalars"].items()):
            i, name = key.split(".", 1)
            opt.state[runtime.params[int(i)]][name] = v
        for k, v in meta["optimizer"].items():
            setattr(opt, k, v)
    return os.path.join(path, "model.safetensors"), meta["client_state"], meta["engine_state"]


class CompressedCheckpoints:
    """:class:`~zero.engine.runtime_protocol.RuntimeCheckpoints` of a ``CompressedRuntime``: this module's format
    (one safetensors file of optimizer state per rank, the model and ``meta.json`` from rank 0). ``model_config``,
    ``save_latest`` and ``exclude_frozen`` do not apply to it."""

    def __init__(self, runtime):
        self.runtime = runtime

    def save(self, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config: dict | None,
             save_latest: bool, exclude_frozen: bool) -> None:  # fmt: skip
        """Collective: :func:`save`."""
        save(self.runtime, save_dir, tag, client_state, engine_state)

    def load(self, load_dir: str, tag: str | None, load_optimizer_states: bool,
             load_module_only: bool) -> tuple[str, dict, dict]:  # fmt: skip
        """:func:`load`: ``(path, client_state, engine_state)``."""
        return load(self.runtime, load_dir, tag, load_optimizer_states)
