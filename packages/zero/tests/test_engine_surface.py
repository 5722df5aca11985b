"""Every public name of DeepSpeed 0.19.8's engine (and the ZeRO-optimizer names integrations read) resolves on zero's
engine, with DeepSpeed's meaning, or raises NotSupportedError naming what to use; never a bare AttributeError.

``deepspeed_engine_names.txt`` is the list DeepSpeed itself gave (``tools/deepspeed_engine_names.py``, run once on
DeepSpeed 0.19.8 at stage 3), so this test needs no DeepSpeed.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks

NAMES = pathlib.Path(__file__).with_name("deepspeed_engine_names.txt")


def _names() -> list[tuple[str, str]]:
    lines = [line.split() for line in NAMES.read_text().splitlines() if line and not line.startswith("#")]
    return [(kind, name) for kind, name in lines]


def _model() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def walk_body(names: list[tuple[str, str]]) -> dict:
    import zero
    from zero.config import NotSupportedError

    model = _model()
    model.id = 3  # an attribute of the user's model, read through the engine as DeepSpeed's __getattr__ does
    cfg = {"train_batch_size": 2, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    served, refused, other = [], [], {}
    for kind, name in names:
        owner = engine if kind == "engine" else engine.optimizer
        try:
            getattr(owner, name)
            served.append(f"{kind} {name}")
        except NotSupportedError as e:
            assert f"engine.{name}" in str(e) and "not supported by zero: " in str(e), str(e)  # names what to use
            assert isinstance(e, AttributeError)  # hasattr() probes answer "absent"
            refused.append(f"{kind} {name}")
        except Exception as e:  # noqa: BLE001  (reported by name, asserted empty)
            other[f"{kind} {name}"] = repr(e)
    try:
        engine.no_such_name_anywhere  # noqa: B018
        missing = None
    except AttributeError as e:
        missing = (type(e).__name__, isinstance(e, NotSupportedError), str(e))
    return {"served": served, "refused": refused, "other": other, "id": engine.id, "missing": missing,
            "inner_state": engine.optimizer.optimizer.state is engine.optimizer.state}  # fmt: skip


def test_every_deepspeed_engine_name_resolves_or_is_refused():
    from zero.engine.surface_refused import REFUSED

    names = _names()
    assert len([n for n in names if n[0] == "engine"]) == 240
    out = run_ranks(walk_body, 1, names, timeout=120)[0]
    assert out["other"] == {}
    assert len(out["served"]) + len(out["refused"]) == len(names)
    assert sorted(n.split()[1] for n in out["refused"]) == sorted(n for k, n in names if n in REFUSED)
    assert all(n.startswith("engine ") for n in out["refused"])  # every optimizer name integrations read is served
    assert out["id"] == 3  # unknown names fall through to the wrapped module
    assert (
        out["missing"][0] == "AttributeError" and not out["missing"][1] and "no_such_name_anywhere" in out["missing"][2]
    )
    assert out["inner_state"]


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.full((4,), float(i))


def _stack(items):
    return torch.stack(items) * 2


def values_body() -> dict:
    import zero
    from zero.partitioning.gathered import GatheredParameters

    out = {}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 7,
        "wall_clock_breakdown": True,
        "memory_breakdown": False,
        "gradient_clipping": 0.5,
        "flops_profiler": {"profile_step": 3, "module_depth": 2, "top_modules": 4},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.9]}},
        "zero_optimization": {"stage": 3, "overlap_comm": False, "reduce_bucket_size": 1000,
                              "stage3_prefetch_bucket_size": 123, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }  # fmt: skip
    engine, *_ = zero.initialize(model=_model(), config=cfg, training_data=Pairs(), collate_fn=_stack)
    rank = torch.distributed.get_rank()
    out["ranks"] = (engine.global_rank, engine.dp_world_size, engine.mp_world_size, engine.sequence_parallel_size,
                    engine.seq_dp_world_size, torch.distributed.get_world_size(engine.data_parallel_group))  # fmt: skip
    out["rank"] = rank
    out["getters"] = {
        n: getattr(engine, n)()
        for n in ("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "gradient_clipping",
                  "flops_profiler_profile_step", "flops_profiler_module_depth", "flops_profiler_top_modules",
                  "zero_overlap_comm", "zero_reduce_bucket_size", "zero_prefetch_bucket_size",
                  "zero_param_persistence_threshold", "zero_optimization_stage", "optimizer_name", "zero_cpu_offload",
                  "zero_legacy_stage1", "autotuning_enabled", "log_level", "managed_gradient_accumulation")
    }  # fmt: skip
    out["optimizer_params"] = engine.optimizer_params()
    out["mom"] = engine.get_mom()
    out["client"] = (engine.client_optimizer, engine.basic_optimizer is engine.optimizer)
    out["fixed"] = (engine.has_moe_layers, engine.losses, engine.pipeline_parallelism, engine.num_experts,
                    engine.communication_data_type, engine.gradient_average)  # fmt: skip
    out["data"] = (engine.training_data.__class__.__name__, engine.collate_fn is _stack)
    loader = engine.deepspeed_io(Pairs(), route="eval")
    out["io"] = [b.tolist() for b in loader]  # in order, this rank's half, collated by initialize's collate_fn
    batch = engine.get_batch_info()
    out["batch"] = [f() for f in batch]
    engine.set_train_batch_size(8)
    out["batch_after"] = (engine.train_batch_size(), engine.gradient_accumulation_steps())
    with pytest.raises(ValueError, match="divisible"):
        engine.set_train_batch_size(6)
    engine.set_train_micro_batch_size(1)
    out["micro_after"] = (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu())
    engine.set_train_micro_batch_size(2)
    engine.set_train_batch_size(4)
    # the module's weights: load a state dict at stage 3 (gathered, rank 0's values) and read it back
    new = {k: torch.full_like(v, 0.25) for k, v in _model().state_dict().items()}
    engine.load_module_state_dict({"module": new}, fetch_z3_params=True)
    with GatheredParameters(list(engine.module.parameters())):
        out["loaded"] = all(torch.equal(p, torch.full_like(p, 0.25)) for p in engine.module.parameters())
    out["names"] = sorted(engine.param_names.values())
    # coalesce_grad_reduction: step() refused inside, the summed gradient equals two plain backward calls
    with engine.coalesce_grad_reduction():
        for i in range(2):
            engine.backward(engine(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank * 10 + i))).sum())
        with pytest.raises(AssertionError, match="inside no_sync"):
            engine.step()
    engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        out["coalesced"] = [p.detach().clone() for p in engine.module.parameters()]
    # deepspeed.zero.unwrap_model_for_generation: the whole model gathered for the block, partitioned after
    x = torch.ones(2, 4)
    with zero.zero.unwrap_model_for_generation(engine) as unwrapped:
        out["unwrapped"] = (unwrapped is engine, [tuple(p.shape) for p in engine.module.parameters()],
                            engine.module(x).detach())  # fmt: skip
    out["after_unwrap"] = ([p.numel() for p in engine.module.parameters()], engine(x).detach())
    from zero.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from zero.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from zero.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from zero.runtime.zero.utils import get_mapping_to_flat_buffer

    opt = engine.optimizer  # DeepSpeed's ZeRO optimizer classes as the checks RLHF frameworks make
    flat = [(o, n) for _, o, n in get_mapping_to_flat_buffer([torch.zeros(2, 3), torch.zeros(4)])]
    out["kinds"] = (isinstance(opt, DeepSpeedZeroOptimizer_Stage3), isinstance(opt, DeepSpeedZeroOptimizer),
                    isinstance(opt.parameter_offload, DeepSpeedZeRoOffload), isinstance(torch.zeros(1), type(opt)),
                    flat)  # fmt: skip
    try:
        DeepSpeedZeroOptimizer_Stage3(opt)
    except zero.NotSupportedError as e:
        out["build_kind"] = str(e)
    out["torch_info"] = dict(zero.git_version_info.torch_info)
    out["version"] = (zero.version, zero.git_version_info.version)  # `deepspeed.version >= "0.16.4"` (OpenRLHF)
    out["tp"] = _replaced_layer(rank)
    engine.destroy()
    return out


def _replaced_layer(rank: int) -> dict:
    """deepspeed.module_inject.layers.GatherReplacedLayerParams on a layer AutoTP split over the 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                            attn_implementation="eager"))  # fmt: skip

    full = llama().model.layers[0].mlp
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}  # fmt: skip
    engine, *_ = zero.initialize(model=llama(), config=cfg)
    mlp = engine.module.model.layers[0].mlp
    out = {}
    for name in ("up_proj", "down_proj"):
        layer, want = getattr(mlp, name), getattr(full, name).weight
        local = layer.weight.detach().clone()
        with zero.module_inject.layers.GatherReplacedLayerParams([layer.weight], layer):
            inside = (torch.equal(layer.weight, want), tuple(layer.weight.shape))
        out[name] = (inside, torch.equal(layer.weight, local), tuple(local.shape))
    with zero.module_inject.layers.GatherReplacedLayerParams([mlp.act_fn], mlp.act_fn):  # not a replaced layer
        out["other"] = True
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    engine.backward(engine(input_ids=ids, labels=ids).loss)  # the layers still train on their shards
    engine.step()
    engine.destroy()  # deepspeed.utils.groups stops answering for this AutoTP mesh
    return out


def test_engine_values_have_deepspeeds_meaning_on_two_ranks():
    outs = run_ranks(values_body, 2, timeout=180)
    ref = _model()
    for p in ref.parameters():
        nn.init.constant_(p, 0.25)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, betas=(0.8, 0.9))
    loss = sum(ref(torch.randn(2, 4, generator=torch.Generator().manual_seed(r * 10 + i))).sum()
               for r in range(2) for i in range(2)) / 2  # fmt: skip
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    for out in outs:
        assert out["ranks"] == (out["rank"], 2, 1, 1, 2, 2)
        assert out["getters"] == {
            "steps_per_print": 7, "wall_clock_breakdown": True, "memory_breakdown": False, "gradient_clipping": 0.5,
            "flops_profiler_profile_step": 3, "flops_profiler_module_depth": 2, "flops_profiler_top_modules": 4,
            "zero_overlap_comm": False, "zero_reduce_bucket_size": 1000, "zero_prefetch_bucket_size": 123,
            "zero_param_persistence_threshold": 0, "zero_optimization_stage": 3, "optimizer_name": "adam",
            "zero_cpu_offload": False, "zero_legacy_stage1": False, "autotuning_enabled": False, "log_level": None,
            "managed_gradient_accumulation": True,
        }  # fmt: skip
        assert out["optimizer_params"] == {"lr": 1e-2, "betas": [0.8, 0.9]}
        assert out["mom"] == [(0.8, 0.9)]
        assert out["client"] == (None, True)
        assert out["fixed"] == (False, None, False, [], torch.float32, True)
        assert out["data"] == ("Pairs", True)
        half = [[float(i)] * 4 for i in range(out["rank"], 8, 2)]  # DistributedSampler without shuffling
        assert out["io"] == [[[2 * v for v in row] for row in half[j : j + 2]] for j in (0, 2)]
        assert out["batch"] == [4, 2, 1]
        assert out["batch_after"] == (8, 2) and out["micro_after"] == (4, 1)
        assert out["loaded"]
        assert out["names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        for got, want in zip(out["coalesced"], ref.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
        same_model, shapes, generated = out["unwrapped"]
        assert same_model and shapes == [tuple(p.shape) for p in ref.parameters()]  # full tensors inside
        assert out["after_unwrap"][0] != [p.numel() for p in ref.parameters()]  # partitioned again
        torch.testing.assert_close(generated, ref(torch.ones(2, 4)).detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(out["after_unwrap"][1], generated)
        assert out["version"][0] == out["version"][1] and out["version"][0].startswith("0.19.8+zero.")
        assert out["kinds"] == (True, False, True, False, [(0, 6), (6, 4)]) and "initialize()" in out["build_kind"]
        info = out["torch_info"]
        assert info["version"] == ".".join(torch.__version__.split("+")[0].split(".")[:2])
        assert set(info) == {"version", "bf16_support", "cuda_version", "nccl_version", "hip_version"}
        tp = out["tp"]
        assert tp["up_proj"] == ((True, (48, 32)), True, (24, 32))  # column split: output features
        assert tp["down_proj"] == ((True, (32, 48)), True, (32, 24))  # row split: input features
        assert tp["other"]
