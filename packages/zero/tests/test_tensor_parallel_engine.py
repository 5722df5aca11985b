"""``zero.initialize`` with a ``tensor_parallel`` section: transformers' tiny Llama split by AutoTP at tp=2, ZeRO
over dp=2 (4 gloo ranks), stages 1 and 2 in one launch, AdamW with weight decay and clipping at 0.5 (active), 3 steps,
each data-parallel rank on its own half of the global batch:

* every rank's parameters (its tensor-parallel shards, and the replicated ones) equal a single-process run's (each
  tensor within 1e-5 in relative L2 norm) and the reported gradient norm equals the single-process norm;
* ``save_16bit_model`` writes the full model, which transformers loads into a plain model equal to the
  single-process one; ``deepspeed.utils.groups``' tensor-parallel getters answer for the mesh until ``destroy()``;
* stage 2 gets its size from ``deepspeed.tp_model_init`` instead of ``autotp_size`` and overlaps the backward
  all-reduce (``tp_overlap_comm``).

The config section's refusals and validation name the key (ZeRO-3 and offload: test_tensor_parallel_zero3)."""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import zero
from zero import parallel_groups as groups
from zero.config import ConfigError, NotSupportedError, load_config
from zero_comm.testing import run_ranks
from zero_parallel import layout_of

TP, DP, MICRO, SEQ, STEPS, LR, EPS, CLIP = 2, 2, 2, 10, 3, 1e-3, 1e-6, 0.5


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")  # fmt: skip
    return LlamaForCausalLM(config)


def _batch(step: int, dp_rank: int | None) -> torch.Tensor:
    """The global batch of ``step`` (``[DP * MICRO, SEQ]``), or data-parallel rank ``dp_rank``'s half of it."""
    ids = torch.randint(0, 64, (DP * MICRO, SEQ), generator=torch.Generator().manual_seed(step))
    return ids if dp_rank is None else ids[dp_rank * MICRO : (dp_rank + 1) * MICRO]


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    # Adam's first update of an element is lr * g / (|g| + eps): near g = 0 its slope is lr / eps, so the fp32
    # rounding by which the split's gradient differs from one process's (~1e-11 absolute, in elements whose
    # gradient is itself 1e-9 to 1e-8: sums that nearly cancel) moves such a parameter lr / eps times as much. At
    # torch's eps 1e-8 that is 1e5 x, a few 1e-6 in one element; eps 1e-6 keeps the amplification at 1e3 x so that
    # the comparison measures the split, while every other element still takes Adam's +-lr steps
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)


def _reference(model: LlamaForCausalLM) -> tuple[dict, list[float]]:
    model = copy.deepcopy(model)
    opt = _optimizer(model)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        ids = _batch(step, None)
        # the mean over data-parallel ranks of each rank's mean loss: what ZeRO's averaged gradient minimises
        loss = sum(model(input_ids=ids[d * MICRO : (d + 1) * MICRO], labels=ids[d * MICRO : (d + 1) * MICRO]).loss
                   for d in range(DP)) / DP  # fmt: skip
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _train(stage: int, save_dir: str) -> dict:
    model = _tiny_llama()
    ref_params, ref_norms = _reference(model)
    section = {"preset_model": "llama", "tp_overlap_comm": stage == 2}
    if stage == 2:
        zero.tp_model_init(model, tp_size=TP, dtype=torch.float32)
    else:
        section["autotp_size"] = TP
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "zero_optimization": {"stage": stage}, "tensor_parallel": section}  # fmt: skip
    engine, *_ = zero.initialize(model=model, optimizer=_optimizer(model), config=config)
    layout = layout_of(engine.module)
    dp_rank = dist.get_rank() // TP  # ranks r and r+1 form a tensor-parallel group
    norms = []
    for step in range(STEPS):
        ids = _batch(step, dp_rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        norms.append(engine.get_global_grad_norm())
    worst, moved = 0.0, float("inf")  # relative error of each tensor: ||got - want|| / ||want||
    initial = dict(_tiny_llama().named_parameters())
    for name, p in engine.module.named_parameters():
        want = ref_params[name]
        if name in layout.shards:
            want = layout.shards[name].shard(want, layout.rank)
        worst = max(worst, ((p.detach() - want).norm() / want.norm()).item())
        start = layout.shards[name].shard(initial[name], layout.rank) if name in layout.shards else initial[name]
        moved = min(moved, (p.detach() - start).abs().max().item())
    engine.save_16bit_model(save_dir)  # gathered over tp: the single-process model's state dict, from rank 0
    tp_group = groups.get_tensor_model_parallel_group()
    mesh = {"tp": (dist.get_process_group_ranks(tp_group), groups.get_tensor_model_parallel_world_size(),
                   groups.get_tensor_model_parallel_rank(), groups.get_tensor_model_parallel_src_rank(),
                   groups.get_model_parallel_world_size(), groups._get_model_parallel_world_size(),
                   engine.get_tensor_parallel_rank()),
            "dp": (dist.get_process_group_ranks(groups._get_data_parallel_group()),
                   groups.get_data_parallel_world_size(), groups._get_data_parallel_rank(),
                   list(groups._get_data_parallel_group_ranks()),
                   groups._get_sequence_data_parallel_world_size())}  # fmt: skip
    saved_worst = None
    if dist.get_rank() == 0:
        plain = LlamaForCausalLM.from_pretrained(save_dir)  # a plain torch model at tp=1
        saved_worst = max(((p.detach() - ref_params[n]).norm() / ref_params[n].norm()).item()
                          for n, p in plain.named_parameters())  # fmt: skip
    out = {"worst": worst, "moved": moved, "saved_worst": saved_worst, "norms": norms, "ref_norms": ref_norms,
           "split": len(layout.shards), "batch": engine.train_batch_size(),
           "zero_group": dist.get_process_group_ranks(engine.runtime.group), "mesh": mesh}  # fmt: skip
    engine.destroy()
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        groups.get_tensor_model_parallel_group()
    out["after_destroy"] = (groups._get_model_parallel_world_size(), groups.get_data_parallel_world_size())
    return out


def _both_stages(save_dir: str) -> list[dict]:
    return [_train(1, f"{save_dir}/stage1"), _train(2, f"{save_dir}/stage2")]


def test_tp2_dp2_zero1_and_zero2_equal_one_process(tmp_path):
    results = run_ranks(_both_stages, TP * DP, str(tmp_path), timeout=180)
    for rank, per_stage in enumerate(results):
        for res in per_stage:
            assert res["worst"] <= 1e-5 and res["moved"] > 5e-5, res  # equal, and every tensor trained
            assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-6), res
            assert min(res["ref_norms"]) > CLIP  # clipping was active: the norm decided each update
            assert res["split"] == 2 * 7 and res["batch"] == DP * MICRO
            assert res["zero_group"] == [rank % TP, rank % TP + TP]
            first = rank // TP * TP
            assert res["mesh"]["tp"] == ([first, first + 1], TP, rank % TP, first, TP, TP, rank % TP), res
            assert res["mesh"]["dp"] == (res["zero_group"], DP, rank // TP, res["zero_group"], DP), res
            assert res["after_destroy"] == (1, TP * DP), res
            assert (res["saved_worst"] is None) == (rank != 0)
    assert all(res["saved_worst"] <= 1e-5 for res in results[0])


def test_section_keys_are_validated_naming_the_field():
    def err(section: dict, kind=ConfigError) -> str:
        with pytest.raises(kind) as e:
            load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": section}, 4)
        return str(e.value)

    assert "tensor_parallel.autotpsize" in err({"autotpsize": 2})
    assert "tensor_parallel.preset_model" in err({"autotp_size": 2, "preset_model": "gpt9"})
    assert "tensor_parallel.partition_config.layer_specs.0.partition_type" in err(
        {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diag"}]}}
    )
    assert "tensor_parallel.partition_config.layer_specs.0.patterns" in err(
        {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": []}]}}
    )
    assert "tp.tp_size (4) differs from autotp_size (2)" in err({"autotp_size": 2, "tp": {"tp_size": 4}})
    assert "'tensor_parallel.autotp_size': 3 does not divide the world size 4" in err({"autotp_size": 3})
    assert "'tensor_parallel.vocab_parallel_lm_head'" in err({"vocab_parallel_lm_head": True}, NotSupportedError)
    sp = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}
    with pytest.raises(NotSupportedError, match="'sequence_parallel_size': 2 with 'tensor_parallel.autotp_size': 2"):
        load_config(sp, 4)
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {
        "autotp_size": 2, "tp_overlap_comm": True, "dtype": "bf16", "keep_module_on_host": True,
        "partition_config": {"use_default_specs": False, "layer_specs": [
            {"patterns": [".*gate_up_proj.weight$"], "partition_type": "COLUMN", "shape": [2, -1],
             "partition_dim": 0}]}}}, 4)  # fmt: skip
    assert cfg.batch.train_batch_size == 2 and cfg.tensor_parallel.dtype == torch.bfloat16
    # train_batch_size counted over every rank (DeepSpeed's check under AutoTP, transformers' "auto" fill): accepted,
    # the step takes micro x gas x dp samples; a count matching neither is refused naming the key
    counted = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                           "train_batch_size": 8, "tensor_parallel": {"autotp_size": 2}}, 4)  # fmt: skip
    assert counted.batch.train_batch_size == 4 and counted.batch.micro_batch_per_gpu == 2
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 6,
                     "tensor_parallel": {"autotp_size": 2}}, 4)  # fmt: skip
    assert cfg.tensor_parallel.partition_config.layer_specs[0].partition_type == "column"


def test_tp_model_init_records_and_conflicts_are_named():
    from zero.engine.tensor_parallel import merge_recorded

    model = torch.nn.Linear(2, 2)
    assert zero.tp_model_init(model, 2, torch.bfloat16) is model
    merged = merge_recorded(model, {"tensor_parallel": {"preset_model": "llama"}})
    assert merged["tensor_parallel"] == {"preset_model": "llama", "autotp_size": 2, "dtype": torch.bfloat16}
    with pytest.raises(ConfigError, match="'tensor_parallel.autotp_size': 4 differs from tp_model_init"):
        merge_recorded(model, {"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(ConfigError, match="'tensor_parallel.dtype'"):
        merge_recorded(model, {"tensor_parallel": {"dtype": "fp16"}})
    with pytest.raises(NotSupportedError, match="tp_group"):
        zero.tp_model_init(model, 2, torch.float32, tp_group=object())
