"""Checkpoints of a model holding DeepSpeed MoE layers: one zero_core checkpoint per expert-parallel rank, each
written by that rank's expert-data-parallel group (the runtime's group; the whole world at ``ep_size`` 1).

Layout of ``<dir>/<tag>/``::

    expert_parallel.json   {"ep_size": P, "world_size": W, "tp_size": T, "split": ...}: T and AutoTP's split
                           record (zero_core's ``tensor_parallel.json`` form) when AutoEP is folded on AutoTP
    layer_<l>_expert_<g>_mp_rank_00_model_states.pt
                           DeepSpeed's per-expert file: MoE layer l's global expert g, its module tensors under
                           their global names (written by the expert-data-parallel group's first rank; for
                           DeepSpeed's tools, not read back here)
    ep_rank_<e>/           expert-parallel rank e's checkpoint (zero_core's sharded format over its
                           expert-data-parallel group: its experts under their local names, and the
                           non-expert parameters, the same in every ep_rank_<e>)

``<dir>/latest`` names the tag. A load reads ``ep_rank_<e>`` of this rank's expert-parallel rank, so a resume at
the same ``ep_size`` is bitwise (zero_core reshards over the expert-data-parallel group as over any group).
:func:`dense_state_dict` (what ``zero_to_fp32``'s ``get_fp32_state_dict_from_zero_checkpoint`` returns for such a
folder) is the state dict of the same model with ``ep_size`` 1: every part consolidated, local expert ``i`` of
expert-parallel rank ``e`` renamed global expert ``e * L + i`` (L: that layer's local experts); an AutoEP block's
fused expert tensors (``<block>.experts.gate_up_proj`` / ``down_proj``, rows of the local experts) are stacked whole
in ep-rank order, giving the transformers model's own state dict. The per-expert files are written for DeepSpeed
MoE layers only (AutoEP's experts are fused). A load at another ``ep_size`` (1 included) re-deals the parts
(:mod:`zero.engine.expert_reshard`). Folded on AutoTP (T > 1), expert-parallel rank ``e`` holds tensor-parallel
rank ``e % T``'s shards: a resume needs the same ``ep_size`` and T (another topology, T 1 included, is refused
naming both sizes), and :func:`dense_state_dict` rebuilds each split parameter from the parts of ep ranks
``0 .. T-1``. Not yet done: DeepSpeed's layout of the rest (``mp_rank_00_model_states.pt``, its optimizer files),
``checkpoint.format`` "deepspeed" / "universal" (refused).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from zero.config import NotSupportedError
from zero.engine.checkpoint_io import split_record
from zero.engine.expert_parallel import moe_layers
from zero.engine.expert_reshard import EXPERT_KEY, FUSED_KEY, local_counts, part_tag, redeal
from zero_comm import same_outcome
from zero_core import GatheredParameters
from zero_core.checkpoint import CheckpointError, ConsolidatedState, full_state_dict, load_checkpoint, save_checkpoint
from zero_core.checkpoint.load import load_saved
from zero_core.checkpoint.split import UNSPLIT, SplitRecord
from zero_parallel.moe import MoE

RECORD = "expert_parallel.json"


class ExpertParallelCheckpoints:
    """:class:`~zero.engine.runtime_protocol.RuntimeCheckpoints` of an expert-parallel model.

    Args:
        runtime: the ZeroRuntime (its group is this rank's expert-data-parallel group).
        ep_size / ep_rank: the expert-parallel size and this rank's place in its group.
        fmt: ``checkpoint.format``; only "zero" is written.
        split: AutoTP's layout (``zero_parallel.TensorParallelLayout``) when AutoEP is folded on it, else None.
    """

    def __init__(self, runtime, ep_size: int, ep_rank: int, fmt: str = "zero", split=None, ep_group=None) -> None:
        self.runtime = runtime
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.format = fmt
        self.split = split
        self.tp_size = split.size if split is not None else 1

    def dense_state(self, dtype: torch.dtype | None) -> dict:
        """Collective (every rank): the state dict of the same model at ``ep_size`` 1 (what :func:`dense_state_dict`
        gives for a checkpoint saved now) on global rank 0, ``{}`` elsewhere; floating tensors in ``dtype``. Each
        rank of global rank 0's expert-parallel group sends it its full part (gathered over its expert-data-parallel
        group first); the other ranks take part in their group's gathers only."""
        part = full_state_dict(self.runtime, dtype, rank0_only=False)
        if self.ep_size == 1:
            return part if dist.get_rank() == 0 else {}
        if 0 not in dist.get_process_group_ranks(self.ep_group):
            return {}
        parts = [None] * self.ep_size if dist.get_rank() == 0 else None
        dist.gather_object(part, parts, dst=0, group=self.ep_group)
        if dist.get_rank() != 0:
            return {}
        return merge_parts(parts, split_record(self.split) if self.split is not None else UNSPLIT)

    def save(self, save_dir: str, tag: str, client_state: dict, engine_state: dict, model_config: dict | None,
             save_latest: bool, exclude_frozen: bool) -> None:  # fmt: skip
        """Collective (every rank). Raises NotSupportedError on every rank for ``checkpoint.format`` other than
        "zero"."""
        if self.format != "zero":
            raise NotSupportedError(f"checkpoint.format '{self.format}' with MoE layers (ep_size={self.ep_size}) is "
                                    "not supported yet; use 'zero'")  # fmt: skip
        root = Path(save_dir) / tag
        with same_outcome("save_checkpoint"):
            if dist.get_rank() == 0:
                root.mkdir(parents=True, exist_ok=True)
                record = {"ep_size": self.ep_size, "world_size": dist.get_world_size(), "tp_size": self.tp_size}
                if self.split is not None:
                    record["split"] = split_record(self.split).to_dict()
                _write(root / RECORD, json.dumps(record))
        dist.barrier()  # the tag's folder exists before any group commits into it
        self._save_experts(root)
        save_checkpoint(self.runtime, root, part_tag(self.ep_rank), client_state=client_state, extra_state=engine_state,
                        model_config=model_config, save_latest=False, exclude_frozen_parameters=exclude_frozen,
                        recovery_script=False).wait()  # fmt: skip
        dist.barrier()  # every expert-parallel rank's part is committed before latest names the tag
        with same_outcome("save_checkpoint"):
            if dist.get_rank() == 0 and save_latest:
                _write(Path(save_dir) / "latest", tag)
        dist.barrier()

    def _save_experts(self, root: Path) -> None:
        """DeepSpeed's ``layer_<l>_expert_<g>_mp_rank_00_model_states.pt`` of this rank's experts. Collective over
        the expert-data-parallel group (stage 3 gathers each layer's experts)."""
        group, files = self.runtime.group, {}
        layers = [m for m in moe_layers(self.runtime.module) if isinstance(m, MoE)]  # AutoEP blocks: fused, no files
        for layer_id, layer in enumerate(layers):
            experts = layer.deepspeed_moe.experts.deepspeed_experts
            prefix = f"{_module_name(self.runtime.module, layer)}.deepspeed_moe.experts.deepspeed_experts"
            with GatheredParameters(list(experts.parameters())):
                if dist.get_rank(group) != 0:
                    continue
                for i, expert in enumerate(experts):
                    g = self.ep_rank * len(experts) + i
                    state = {f"{prefix}.{g}.{k}": v.detach().clone() for k, v in expert.state_dict().items()}
                    files[root / f"layer_{layer_id}_expert_{g}_mp_rank_00_model_states.pt"] = state
        with same_outcome("save_checkpoint", group):  # a failed write is raised on every rank of the group
            for path, state in files.items():
                torch.save(state, path)

    def load(self, load_dir: str, tag: str | None, load_optimizer_states: bool,
             load_module_only: bool) -> tuple[str, dict, dict]:  # fmt: skip
        """Collective. At the same ``ep_size`` this rank's part loads as any checkpoint (bitwise, RNG included); at
        another, the parts are re-dealt (:mod:`zero.engine.expert_reshard`; no RNG). Raises (on every rank: they
        read the same files) CheckpointError naming a missing ``latest``, record or parameter."""
        with same_outcome("load_checkpoint"):
            root = Path(load_dir) / (tag if tag is not None else _read(Path(load_dir) / "latest"))
            record = json.loads(_read(root / RECORD))
            saved, saved_tp = record["ep_size"], record.get("tp_size", 1)
            if (saved_tp > 1 or self.tp_size > 1) and (saved, saved_tp) != (self.ep_size, self.tp_size):
                raise CheckpointError(f"{root} was saved at expert_parallel.autoep_size {saved} and tensor_parallel."
                                      f"autotp_size {saved_tp}; this model runs at autoep_size {self.ep_size} and "
                                      f"autotp_size {self.tp_size}: AutoEP folded on AutoTP resumes at the same two "
                                      "sizes only (zero_to_fp32 gives the dense state dict to start from)")  # fmt: skip
        if saved != self.ep_size:
            names = [n for n, p in self.runtime.module.named_parameters() if p.is_floating_point()]
            res = load_saved(self.runtime, lambda: redeal(root, saved, self.ep_rank, names, self.ep_size),
                             load_optimizer_states=load_optimizer_states, load_module_only=load_module_only,
                             load_rng=False)  # fmt: skip
            return str(root), res.client_state, res.extra_state
        res = load_checkpoint(self.runtime, root, part_tag(self.ep_rank), load_optimizer_states=load_optimizer_states,
                              load_module_only=load_module_only)  # fmt: skip
        return str(root), res.client_state, res.extra_state


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def expert_parallel_root(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path | None:
    """``checkpoint_dir/tag`` (None: the tag in ``latest``) when it is an expert-parallel checkpoint, else None."""
    latest = Path(checkpoint_dir) / "latest"
    if tag is None and not latest.is_file():
        return None
    root = Path(checkpoint_dir) / (tag if tag is not None else latest.read_text().strip())
    return root if (root / RECORD).is_file() else None


def dense_state_dict(root: Path, dtype: torch.dtype = torch.float32, exclude_frozen: bool = False) -> dict:
    """The consolidated state dict of the expert-parallel checkpoint folder ``root`` under the names of the same
    model with ``ep_size`` 1 (see the module docstring); floating tensors in ``dtype``.

    Raises:
        CheckpointError naming a missing or corrupt file.
    """
    record = json.loads(_read(root / RECORD))
    parts = [
        dict(ConsolidatedState(root, part_tag(e), dtype, exclude_frozen).items()) for e in range(record["ep_size"])
    ]
    return merge_parts(parts, SplitRecord.from_dict(record["split"]) if "split" in record else UNSPLIT)


def merge_parts(parts: list[dict], split: SplitRecord = UNSPLIT) -> dict:
    """One state dict from the full state dicts of expert-parallel ranks ``0 .. P-1`` (``parts``, in ep-rank
    order): local expert ``i`` of rank ``e`` renamed global expert ``e * L + i``, an AutoEP block's fused expert
    tensors stacked in ep-rank order, each tensor-parallel parameter of ``split`` rebuilt from the parts of ep ranks
    ``0 .. T-1``, the other tensors taken from rank 0's part (the same in every part)."""
    local = local_counts(parts[0])  # expert prefix -> local experts of that layer
    out = {}
    for e, part in enumerate(parts):
        for key, value in part.items():
            m = EXPERT_KEY.match(key)
            if FUSED_KEY.match(key):  # an AutoEP block's fused experts: every part's rows, in ep-rank order
                out[key] = torch.cat([p[key] for p in parts]) if e == 0 else out[key]
            elif m is not None:
                out[f"{m[1]}{e * local[m[1]] + int(m[2])}{m[3]}"] = value
            elif e == 0 and key in split.params:  # ep rank t < T holds tensor-parallel rank t's shard
                out[key] = split.params[key].unshard([parts[t][key] for t in range(split.size)])
            elif e == 0:  # the other non-expert tensors are the same in every part
                out[key] = value
    return out


def write_dense(root: Path, out_dir: Path, safe_serialization: bool, exclude_frozen: bool = False) -> Path:
    """Write :func:`dense_state_dict` of ``root`` (fp32) into ``out_dir`` as one ``model.safetensors``
    (``safe_serialization``) or ``pytorch_model.bin``, plus ``config.json`` when the model's config was saved;
    returns the weight file's path. Raises CheckpointError naming a missing or corrupt file."""
    from safetensors.torch import save_file

    state = dense_state_dict(root, torch.float32, exclude_frozen)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / ("model.safetensors" if safe_serialization else "pytorch_model.bin")
    if safe_serialization:
        save_file({k: v.contiguous() for k, v in state.items()}, str(target), metadata={"format": "pt"})
    else:
        torch.save(state, target)
    model_config = ConsolidatedState(root, part_tag(0), torch.float32, exclude_frozen).meta.get("model_config")
    if model_config is not None:
        (out_dir / "config.json").write_text(json.dumps(model_config, indent=2))
    return target


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read(path: Path) -> str:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: not a checkpoint of a model with MoE layers of ep_size > 1")
    return path.read_text().strip()
