"""AutoTP composed with ZeRO-3 and with CPU offload: transformers' tiny Llama split at tp=2, ZeRO over the data-parallel
ranks of each tensor-parallel rank (the split parameters partitioned as ordinary parameters of that rank's module),
AdamW with weight decay and clipping at 0.5 (active), 3 steps, each data-parallel rank on its own part of the global
batch.

At 4 gloo ranks (tp 2 x dp 2), in one launch: stage 3 (every parameter partitioned: persistence threshold 0) with the
model built under ``zero.Init``; stages 1, 2 and 3 with ``offload_optimizer.device: cpu`` (stage 3 with
``tp_overlap_comm``); stage 3 with the optimizer and the parameters offloaded to the CPU. At 2 ranks (tp 2 x dp 1):
stage 3 without and with both offloads, each then saving with ``save_16bit_model`` the full model, which transformers
loads at tp=1 equal to the single-process one. In each, every step's loss and gradient norm equal a single-process
run's, and every full parameter (the tensor-parallel shards all-gathered and joined, ZeRO's partitions gathered) equals
the single-process one (each tensor within 1e-5 in relative L2 norm), every one of them trained.

Checkpoints (4 ranks, stage 3 with both offloads): a fresh tp 2 x dp 2 engine resumes bit for bit (its full parameters
at load, and its parameters, fp32 masters and optimizer state after one more step, ``torch.equal``), and a tp=1 engine
(ZeRO-3 over all 4 ranks) loads it with every parameter equal to the gathered full one; its own checkpoint, one step on,
loads back into a tp 2 x dp 2 stage-3 engine with every full parameter equal. On the resumed engine,
``GatherReplacedLayerParams`` inside ``zero.GatheredParameters`` gives the full weight, and an edit there with
``modifier_rank=0`` reaches the trained weights; outside it, a clear error.

Offload to NVMe with AutoTP is refused naming the key."""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import zero
from zero.config import NotSupportedError, load_config
from zero.engine.gather_replaced import GatherReplacedLayerParams
from zero.engine.tensor_parallel import gather_full_state
from zero_comm.testing import run_ranks
from zero_core.checkpoint import full_state_dict
from zero_parallel import layout_of

TP, MICRO, SEQ, STEPS, LR, EPS, CLIP = 2, 2, 10, 3, 1e-3, 1e-6, 0.5
# (stage, what is offloaded to the CPU) at tp 2 x dp 2; stage 3 without offload builds the model under zero.Init
# (partitioned over all ranks before AutoTP splits it)
VARIANTS = ((3, ""), (1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "optimizer+param"))


def _tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # the same weights on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="eager")  # fmt: skip
    return LlamaForCausalLM(config)


def _batch(step: int, dp: int) -> torch.Tensor:
    """The global batch of ``step``: ``[dp * MICRO, SEQ]`` token ids; data-parallel rank d takes rows d*MICRO on."""
    return torch.randint(0, 64, (dp * MICRO, SEQ), generator=torch.Generator().manual_seed(step))


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    # eps 1e-6 as in test_tensor_parallel_engine: Adam's near-zero-gradient slope lr / eps stays 1e3 x
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)


def _reference(dp: int) -> tuple[dict, list[list[float]], list[float]]:
    """The single-process run: final parameters, per step each data-parallel part's loss, per step the norm."""
    model = copy.deepcopy(_tiny_llama())
    opt = _optimizer(model)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        ids = _batch(step, dp)
        # the mean over data-parallel ranks of each rank's mean loss: what ZeRO's averaged gradient minimises
        parts = [model(input_ids=ids[d * MICRO : (d + 1) * MICRO], labels=ids[d * MICRO : (d + 1) * MICRO]).loss
                 for d in range(dp)]  # fmt: skip
        (sum(parts) / dp).backward()
        losses.append([p.item() for p in parts])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses, norms


def _engine(stage: int, offload: str, tp: int = TP, seed: int = 0):
    if stage == 3 and not offload:
        with zero.Init():
            model = _tiny_llama(seed)
    else:
        model = _tiny_llama(seed)
    # stage 3: every parameter partitioned; save_16bit_model gathers the full model
    zo = {"stage": stage, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
    if "optimizer" in offload:
        zo["offload_optimizer"] = {"device": "cpu"}
    if "param" in offload:
        zo["offload_param"] = {"device": "cpu"}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": CLIP,
              "zero_optimization": zo}  # fmt: skip
    if tp > 1:
        # the backward all-reduce overlapped with the weight gradient in one stage-3 variant
        overlap = stage == 3 and offload == "optimizer"
        config["tensor_parallel"] = {"autotp_size": tp, "preset_model": "llama", "tp_overlap_comm": overlap}
    engine, *_ = zero.initialize(model=model, optimizer=_optimizer(model), config=config)
    return engine


def _full(engine) -> dict:
    """The single-process state dict of the engine's model (collective; every rank gets it)."""
    state = full_state_dict(engine.runtime, rank0_only=False)
    layout = layout_of(engine.module)
    return state if layout is None else gather_full_state(state, layout)


def _step(engine, step: int) -> float:
    dp = dist.get_world_size() // TP
    d = dist.get_rank() // TP  # ranks r and r+1 form a tensor-parallel group
    ids = _batch(step, dp)[d * MICRO : (d + 1) * MICRO]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _master_state(engine) -> dict:
    """This rank's fp32 master partition and optimizer state per flat group (in host memory with the offload)."""
    rt, out = engine.runtime, {}
    for g in rt.flat_groups:
        if rt.master.master_shard(g) is not None:
            out[f"master/{g.index}"] = rt.master.master_shard(g).detach().clone()
            out.update({f"optim/{g.index}/{k}": v.clone() for k, v in rt.master.state_shard(g).items()})
    return out


def _worst(full: dict, want: dict) -> float:
    return max(((full[n] - w).norm() / w.norm()).item() for n, w in want.items())


def _train(stage: int, offload: str, ref: tuple, save_dir: str | None = None) -> dict:
    ref_params, ref_losses, ref_norms = ref
    initial = dict(_tiny_llama().named_parameters())
    engine = _engine(stage, offload)
    d = dist.get_rank() // TP
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(_step(engine, step))
        norms.append(engine.get_global_grad_norm())
    full = _full(engine)
    out = {"variant": (stage, offload), "losses": losses, "ref_losses": [row[d] for row in ref_losses],
           "norms": norms, "ref_norms": ref_norms, "worst": _worst(full, ref_params),
           "moved": min((full[n] - initial[n]).abs().max().item() for n in ref_params),
           "split": len(layout_of(engine.module).shards),
           "zero_group": dist.get_process_group_ranks(engine.runtime.group)}  # fmt: skip
    if save_dir is not None:  # the full model, gathered over dp and tp, loaded by transformers at tp=1
        engine.save_16bit_model(save_dir)
        plain = dict(LlamaForCausalLM.from_pretrained(save_dir).named_parameters())
        out["saved_worst"] = _worst({n: p.detach() for n, p in plain.items()}, ref_params)
    engine.destroy()
    return out


def _resume(root: str) -> dict:
    """Save at tp 2 x dp 2 stage 3 with both offloads, resume there bit for bit, load at tp=1."""
    a = _engine(3, "optimizer+param")
    for step in range(2):
        _step(a, step)
    a.save_checkpoint(root, "tp2")
    saved = _full(a)
    _step(a, 2)
    after_full = _full(a)
    after_state = _master_state(a)
    a.destroy()

    b = _engine(3, "optimizer+param", seed=3)
    b.load_checkpoint(root, "tp2")
    out = {"steps": b.global_steps, "resumed_full": all(torch.equal(v, saved[k]) for k, v in _full(b).items())}
    _step(b, 2)
    got = _full(b)
    out["params_bitwise"] = got.keys() == after_full.keys() and all(
        torch.equal(v, after_full[k]) for k, v in got.items()
    )
    state = _master_state(b)
    out["state_bitwise"] = (
        any(k.startswith("optim/") for k in state)
        and state.keys() == after_state.keys()
        and all(torch.equal(v, after_state[k]) for k, v in state.items())
    )
    out["replaced"] = _gather_replaced(b)
    b.destroy()

    c = _engine(3, "optimizer", tp=1, seed=5)  # ZeRO-3 over all 4 ranks, no split
    c.load_checkpoint(root, "tp2")
    out["tp1_equal"] = all(torch.equal(v, saved[k]) for k, v in _full(c).items())
    _step(c, 2)
    c.save_checkpoint(root, "tp1")
    c_full = _full(c)
    c.destroy()

    d = _engine(3, "optimizer+param", seed=11)  # the plain stage-3 checkpoint into a tp 2 x dp 2 stage-3 engine
    d.load_checkpoint(root, "tp1")
    out["tp1_into_tp2"] = all(torch.equal(v, c_full[k]) for k, v in _full(d).items())
    d.destroy()
    return out


def _gather_replaced(engine) -> dict:
    """GatherReplacedLayerParams nested in zero.GatheredParameters (DeepSpeed's consolidated save) at stage 3: the
    full weight inside; an edit with modifier_rank 0 (of each data-parallel group) reaches the trained weights."""
    layer = engine.module.model.layers[0].mlp.down_proj  # row-parallel: split along its input features
    key = "model.layers.0.mlp.down_proj.weight"
    before = _full(engine)[key]
    out = {}
    try:
        with GatherReplacedLayerParams([layer.weight], layer):
            pass
    except RuntimeError as e:
        out["outside"] = str(e)
    with zero.GatheredParameters([layer.weight]), GatherReplacedLayerParams([layer.weight], layer):
        out["read"] = torch.equal(layer.weight.detach(), before)
    with zero.GatheredParameters([layer.weight], modifier_rank=0), GatherReplacedLayerParams([layer.weight], layer):
        layer.weight.data.mul_(2.0)
    out["edited"] = torch.equal(_full(engine)[key], before * 2.0)
    return out


def _four_ranks(root: str) -> dict:
    ref = _reference(dist.get_world_size() // TP)
    return {"runs": [_train(stage, offload, ref) for stage, offload in VARIANTS], "resume": _resume(root)}


def _two_ranks(root: str) -> list[dict]:
    ref = _reference(1)
    return [_train(3, "", ref, f"{root}/plain"), _train(3, "optimizer+param", ref, f"{root}/offload")]


def _check(res: dict, rank: int, dp: int) -> None:
    assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-5), res
    assert res["norms"] == pytest.approx(res["ref_norms"], rel=1e-6), res
    assert min(res["ref_norms"]) > CLIP  # clipping was active: the norm decided each update
    assert res["worst"] <= 1e-5 and res["moved"] > 5e-5, res  # equal, and every tensor trained
    assert res["split"] == 2 * 7
    assert res["zero_group"] == [rank % TP + TP * d for d in range(dp)], res


def test_tp2_dp2_zero3_and_cpu_offload_equal_one_process_and_resume_bitwise(tmp_path):
    results = run_ranks(_four_ranks, TP * 2, str(tmp_path), timeout=300)
    for rank, res in enumerate(results):
        assert [r["variant"] for r in res["runs"]] == list(VARIANTS)
        for run in res["runs"]:
            _check(run, rank, 2)
        resume = res["resume"]
        assert resume["steps"] == 2 and resume["resumed_full"], resume
        assert resume["params_bitwise"] and resume["state_bitwise"] and resume["tp1_equal"], resume
        assert resume["tp1_into_tp2"], resume
        replaced = resume["replaced"]
        assert "enter zero.GatheredParameters" in replaced["outside"], replaced
        assert replaced["read"] and replaced["edited"], replaced


def test_tp2_dp1_zero3_without_and_with_cpu_offload_equal_one_process(tmp_path):
    for rank, per_rank in enumerate(run_ranks(_two_ranks, TP, str(tmp_path), timeout=180)):
        assert [r["variant"] for r in per_rank] == [(3, ""), (3, "optimizer+param")]
        for run in per_rank:
            _check(run, rank, 1)
            assert run["saved_worst"] <= 1e-5, run


def test_offload_to_nvme_with_autotp_is_refused_naming_the_key(tmp_path):
    for key in ("offload_optimizer", "offload_param"):
        config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2},
                  "zero_optimization": {"stage": 3, key: {"device": "nvme", "nvme_path": str(tmp_path)}}}  # fmt: skip
        with pytest.raises(NotSupportedError, match=f"'zero_optimization.{key}.device': 'nvme' with "
                                                    "'tensor_parallel.autotp_size': 2"):  # fmt: skip
            load_config(config, 4)
    for stage in (1, 2, 3):  # CPU offload composes
        config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2},
                  "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip
        assert load_config(config, 4).tensor_parallel.size == 2
