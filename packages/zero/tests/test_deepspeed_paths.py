"""The DeepSpeed module paths that transformers, Accelerate, TRL and PEFT import, served by zero.

Each path in ``zero.compat.names.IMPORT_PATHS`` imports under ``install_as_deepspeed()`` and gives zero's object;
every ``NOT_YET`` name raises the same ``NotSupportedError`` on ``from deepspeed.X import Y`` as on attribute
access; ``deepspeed.utils.groups`` answers for the plain data-parallel world on 2 gloo ranks.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

import zero
from zero.compat import UnsupportedName, alias
from zero.compat.names import IMPORT_PATHS, NOT_YET
from zero_comm.testing import run_ranks


@pytest.fixture
def as_deepspeed():
    alias.install_as_deepspeed()
    yield
    alias.uninstall_as_deepspeed()


def _from_import(module: str, name: str):
    scope: dict = {}
    exec(f"from {module} import {name} as obj", scope)  # the statement integrations run, not importlib's API
    return scope["obj"]


def test_integration_paths_resolve_to_zero(as_deepspeed):
    from zero.as_deepspeed.runtime.activation_checkpointing import offload_activations
    from zero.as_deepspeed.runtime.sequence_parallel import ulysses_sp
    from zero.checkpoint_tools.torch_save import clone_tensors_for_torch_save
    from zero.optim.schedulers import SCHEDULERS
    from zero_parallel import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from zero_parallel.moe import MoE
    from zero_parallel.moe import split_params_into_different_moe_groups_for_optimizer as split_moe_groups

    expected = {
        "deepspeed.utils.groups": zero.utils.groups,
        "deepspeed.utils.logger": zero.utils.logger,
        "deepspeed.pipe.PipelineModule": zero.PipelineModule,
        "deepspeed.runtime.pipe.engine.PipelineEngine": zero.PipelineEngine,
        "deepspeed.moe.layer.MoE": MoE,
        "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer": split_moe_groups,
        "deepspeed.runtime.engine.DeepSpeedEngine": zero.Engine,
        "deepspeed.runtime.utils.move_to_device": zero.nested_tensors.move_to_device,
        "deepspeed.runtime.zero.partition_parameters": zero.runtime.zero.partition_parameters,
        "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME": ".deepspeed_env",
        "deepspeed.checkpoint.utils.clone_tensors_for_torch_save": clone_tensors_for_torch_save,
        "deepspeed.accelerator.get_accelerator": zero.accelerator.get_accelerator,
        "deepspeed.ops.adam.DeepSpeedCPUAdam": zero.optim.adam.DeepSpeedCPUAdam,
        "deepspeed.comm": zero.comm,
        "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF": UlyssesSPAttentionHF,
        "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter": UlyssesSPDataLoaderAdapter,
        "deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP": ulysses_sp.TiledMLP,
        "deepspeed.runtime.sequence_parallel.ulysses_sp.TiledFusedLogitsLoss": ulysses_sp.TiledFusedLogitsLoss,
        "deepspeed.runtime.sequence_parallel.ulysses_sp.SequenceTiledCompute": ulysses_sp.SequenceTiledCompute,
        "deepspeed.runtime.activation_checkpointing.offload_activations.CheckpointHiddenStatesOffload": (
            offload_activations.CheckpointHiddenStatesOffload
        ),
        "deepspeed.zero.unwrap_model_for_generation": zero.partitioning.generation.unwrap_model_for_generation,
        "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum": zero.engine.offload_states.OffloadStateTypeEnum,
        "deepspeed.module_inject.layers.GatherReplacedLayerParams": (
            zero.engine.gather_replaced.GatherReplacedLayerParams
        ),
        "deepspeed.git_version_info.torch_info": zero.compat.version_info.torch_info,
        "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3": (
            zero.engine.optimizer_kinds.DeepSpeedZeroOptimizer_Stage3
        ),
    }
    for path, _ in IMPORT_PATHS:
        module, name = path.rsplit(".", 1)
        got = _from_import(module, name)
        if name == "VALID_LR_SCHEDULES":
            assert got == sorted(SCHEDULERS) and "WarmupLR" in got
        else:
            assert got is expected[path] or got == expected[path], path


@pytest.mark.parametrize("name", NOT_YET)
def test_from_import_of_an_unsupported_name_explains(as_deepspeed, name):
    module, last = name.rsplit(".", 1)
    with pytest.raises(UnsupportedName) as by_attr:
        getattr(importlib.import_module(module), last)
    with pytest.raises(UnsupportedName) as by_import:
        _from_import(module, last)
    assert str(by_import.value) == str(by_attr.value) and name in str(by_import.value)
    zero_module = "zero.as_deepspeed" + module[len("deepspeed") :] if module != "deepspeed" else "zero"
    with pytest.raises(UnsupportedName, match=name.replace(".", r"\.")):
        _from_import(zero_module, last)  # the façade's paths (and `from zero import moe`) explain too


def test_submodules_of_unsupported_packages_explain(as_deepspeed):
    for stmt, name in (
        ("import deepspeed.ops.lion", "deepspeed.ops.lion"),
        ("from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad", "deepspeed.ops.adagrad"),
    ):
        with pytest.raises(UnsupportedName, match=name):
            exec(stmt, {})
    assert not hasattr(zero.ops, "lion")  # probes still answer "absent"
    with pytest.raises(ModuleNotFoundError):  # a name zero does not know stays an ordinary missing module
        exec("import deepspeed.runtime.no_such_module", {})


def test_move_to_device_follows_deepspeeds_contract():
    from zero.nested_tensors import move_to_device

    a, b = torch.ones(3), torch.zeros(2, dtype=torch.int64)
    moved = move_to_device([a, {"k": (b, 7)}], "meta")
    assert isinstance(moved, list) and isinstance(moved[1]["k"], tuple) and moved[1]["k"][1] == 7
    assert moved[0].device.type == "meta" and moved[1]["k"][0].dtype == torch.int64 and a.device.type == "cpu"
    only_float = move_to_device([a, b], "cpu", lambda t: isinstance(t, torch.Tensor) and t.is_floating_point())
    assert only_float[0] is a and only_float[1] is b  # in place for the chosen leaves, untouched otherwise


def groups_body() -> dict:
    from zero.as_deepspeed.utils import groups

    rank = dist.get_rank()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=groups._get_data_parallel_group())
    try:
        groups._get_sequence_parallel_group()
        sp_group = "returned"
    except KeyError as e:
        sp_group = str(e)
    try:
        groups._get_expert_parallel_group("ep_size_2")
        expert = "returned"
    except KeyError as e:  # no MoE layer made the groups
        expert = str(e)
    return {
        "dp": (groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()),
        "public": (groups.get_data_parallel_world_size(), groups.get_data_parallel_rank()),
        "ranks": list(groups._get_data_parallel_group_ranks()),
        "same_group": groups._get_data_parallel_group() is groups.get_data_parallel_group() is dist.group.WORLD,
        "sum": t.item(),
        "sp": (groups._get_sequence_parallel_world_size(), groups._get_sequence_parallel_rank()),
        "sdp": (groups._get_sequence_data_parallel_world_size(), groups._get_sequence_data_parallel_rank()),
        "sdp_group": groups._get_sequence_data_parallel_group() is dist.group.WORLD,
        "mp": groups._get_model_parallel_world_size(),
        "src": groups._get_broadcast_src_rank(),
        "sp_group": sp_group,
        "expert": expert,
    }


def test_groups_answer_for_the_data_parallel_world():
    outs = run_ranks(groups_body, 2, timeout=60)
    for rank, out in enumerate(outs):
        assert out["dp"] == out["public"] == out["sdp"] == (2, rank)
        assert out["ranks"] == [0, 1] and out["same_group"] and out["sdp_group"]
        assert out["sum"] == 3.0 and out["sp"] == (1, 0) and out["mp"] == 1 and out["src"] == 0
        assert "No sequence parallel group" in out["sp_group"]
        assert (
            "no expert-parallel group named 'ep_size_2'" in out["expert"]
            and "set_deepspeed_parallelism" in out["expert"]
        )


def test_groups_without_a_process_group_name_the_call(monkeypatch):
    from zero.as_deepspeed.utils import groups

    # a script that asks before init_distributed(); other tests of this process may have left a group up
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"_get_data_parallel_world_size\(\): no process group"):
        groups._get_data_parallel_world_size()
