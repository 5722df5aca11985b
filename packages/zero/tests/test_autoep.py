"""AutoEP: the ``expert_parallel`` config section turns a tiny transformers Mixtral / Qwen3-MoE into an
expert-parallel model at initialize(), and its training equals the unconverted model trained in one process on
every rank's batch: on 2 gloo ranks (autoep_size 2) and on 4 (autoep_size 2: two ranks hold each expert; and 4),
at ZeRO stages 0-3 (also with a torch optimizer passed to initialize() over the unconverted model's parameters,
with the model built under zero.Init, and with ``top_k`` 1 set in the section against a top-1 model), every
rank's loss and every parameter after each step (each rank's expert rows against the reference's) equal the
reference's (fp32, 1e-6). Routing is dropless and the model's own. Folded with AutoTP (``tensor_parallel.autotp_size``
2 on the same ranks: the two ranks of a tensor-parallel group read one batch, each routing half its tokens) the
same holds against the reference trained on world / 2 batches, every split parameter gathered to its full shape,
on 2 ranks (autoep_size 2) and on 4 (autoep_size 2 and 4, with data parallelism), at ZeRO stages 0-3."""

import os
import sys

import pytest
import torch

import zero
from zero.engine.tensor_parallel import gather_full_state
from zero_comm.testing import run_ranks
from zero_parallel import layout_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autoep_models import LR, STEPS, build, config, data, local_rows, reference, tensor_parallel  # noqa: E402


def _train(kind: str, ep: int, stage: int, how: str = "") -> list:
    """``how``: "" (the config's optimizer), "client optimizer" (a torch optimizer over the unconverted model's
    parameters passed to initialize), "zero.Init" (the model built under zero.Init), "autotp 2" (folded with
    AutoTP over pairs of ranks, which read the same batch)."""
    preset = {"preset_model": kind} if kind == "qwen3_moe" else {}
    if how == "top_k 1":
        preset["top_k"] = 1
    cfg = config(stage, ep, **preset)
    tp = 2 if how == "autotp 2" else 1
    if tp > 1:
        cfg["tensor_parallel"] = tensor_parallel(kind, tp)
    optimizer = None
    if how == "zero.Init":
        with zero.zero.Init(config_dict_or_path=cfg):
            model = build(kind)
    else:
        model = build(kind)
    if how == "client optimizer":
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
    engine, *_ = zero.initialize(model=model, optimizer=optimizer, config=cfg)
    rank, out = torch.distributed.get_rank(), []
    split = layout_of(engine.module)
    for step in range(STEPS):
        ids = data(step, rank // tp)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        params = engine.runtime.full_parameters()
        out.append((loss.item(), params if split is None else gather_full_state(params, split)))
    engine.destroy()
    # the plain module again: no gradient hook averages the router's gradient over the expert-parallel group
    ids = data(STEPS, rank // tp)
    engine.module(input_ids=ids, labels=ids).loss.backward()
    return out, engine.module.model.layers[0].mlp.gate.weight.grad


def _body(runs) -> list:
    return [_train(*run) for run in runs]


def _tp(how: list) -> int:
    return 2 if how == ["autotp 2"] else 1


def _check(world: int, runs, results) -> None:
    refs = {(kind, *how): reference(kind, world // _tp(how), top_k=1 if how == ["top_k 1"] else 2)
            for kind, _, _, *how in runs}  # fmt: skip
    for r, (kind, ep, stage, *how) in enumerate(runs):
        where = f"{kind} world {world} autoep_size {ep} stage {stage} {how} after destroy()"
        if _tp(how) > 1:  # the router's gradient is whole on both ranks of a tensor-parallel group
            torch.testing.assert_close(results[0][r][1], results[1][r][1], rtol=1e-6, atol=1e-7, msg=where)
        else:  # after destroy() each rank's router gradient is its own
            assert not torch.allclose(results[0][r][1], results[ep - 1][r][1], rtol=1e-3, atol=0), where
    for rank, per_rank in enumerate(results):
        for (kind, ep, stage, *how), (steps, _) in zip(runs, per_rank):
            for step, ((loss, params), (ref_losses, ref_params)) in enumerate(zip(steps, refs[(kind, *how)])):
                where = f"{kind} world {world} autoep_size {ep} stage {stage} {how} rank {rank} step {step}"
                assert loss == pytest.approx(ref_losses[rank // _tp(how)], rel=1e-6), where
                assert sorted(params) == sorted(ref_params), where
                for name, value in params.items():
                    want = local_rows(name, ref_params[name], ep, rank % ep)
                    torch.testing.assert_close(
                        value, want, rtol=1e-6, atol=1e-6, msg=lambda m, w=where, n=name: f"{w}: {n}\n{m}"
                    )


def test_autoep_training_equals_the_unconverted_model_on_two_ranks():
    runs = [("mixtral", 2, 0), ("mixtral", 2, 1), ("mixtral", 2, 2), ("mixtral", 2, 3), ("qwen3_moe", 2, 1),
            ("qwen3_moe", 2, 3), ("mixtral", 2, 2, "client optimizer"), ("mixtral", 2, 3, "zero.Init"),
            ("mixtral", 2, 1, "top_k 1"), ("mixtral", 2, 0, "autotp 2"), ("mixtral", 2, 1, "autotp 2"),
            ("mixtral", 2, 2, "autotp 2"), ("mixtral", 2, 3, "autotp 2"), ("qwen3_moe", 2, 2, "autotp 2")]  # fmt: skip
    _check(2, runs, run_ranks(_body, 2, runs, timeout=300))


def test_autoep_training_with_expert_data_parallelism_equals_the_unconverted_model_on_four_ranks():
    runs = [("mixtral", 2, 0), ("mixtral", 2, 2), ("mixtral", 4, 1), ("mixtral", 4, 3), ("qwen3_moe", 4, 2),
            ("mixtral", 2, 1, "autotp 2"), ("mixtral", 2, 3, "autotp 2"), ("mixtral", 4, 0, "autotp 2"),
            ("mixtral", 4, 2, "autotp 2")]  # fmt: skip
    results = run_ranks(_body_and_errors, 4, runs, timeout=300, threads=1)
    _check(4, runs, [trained for trained, _ in results])
    for _, (tp_four, tp_three) in results:  # every rank raises
        assert "'expert_parallel.autoep_size': 2 and 'tensor_parallel.autotp_size': 4" in tp_four
        assert "folds AutoEP onto AutoTP when autoep_size is a multiple of autotp_size" in tp_four
        assert "'tensor_parallel.autotp_size': 3 does not divide the world size 4" in tp_three


def _body_and_errors(runs) -> tuple:
    return _body(runs), _folding_errors_on_four_ranks()


def _messages(cases) -> list:
    out = []
    for model, cfg in cases:
        try:
            zero.initialize(model=model, config=cfg)
            out.append("no error")
        except (ValueError, zero.config.ConfigError, zero.config.NotSupportedError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def _folded(stage: int, ep: int, tp: int = 2, **autoep) -> dict:
    return {**config(stage, ep, **autoep), "tensor_parallel": tensor_parallel("mixtral", tp)}


def _errors() -> list:
    """The message each bad setting raises (every rank runs every case)."""
    offload = _folded(1, 2)
    offload["zero_optimization"] = {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    offload["zero_allow_untested_optimizer"] = True
    return _messages([
        (build("mixtral", experts=3), config(1, 2)),  # 3 experts over 2 ranks
        (build("mixtral"), config(1, 4)),  # 4 ranks per group on a world of 2
        (build("mixtral"), config(1, 2, moe_layer_pattern=r"model\.blocks\.\d+\.moe")),  # matches nothing
        (torch.nn.Linear(4, 4), config(1, 1)),  # no MoE block at all
        (build("mixtral"), _folded(1, 1)),  # folded, but every rank holds every expert
        (build("mixtral"), {**_folded(1, 2), "use_data_before_expert_parallelism": True}),
        (build("mixtral"), _folded(1, 2, preset_model="qwen3_moe")),  # the two sections' presets differ
        (build("mixtral"), offload),
        (build("mixtral", experts=3), _folded(1, 2)),  # 3 experts over 2 ranks, folded
        (build("mixtral"), config(1, 2, load_balance_coeff=0.01)),
    ])  # fmt: skip


def _folding_errors_on_four_ranks() -> list:
    """autoep_size 2 on autotp_size 4; autotp_size (and autoep_size) 3 not dividing the world."""
    return _messages([(build("mixtral"), _folded(1, 2, tp=4)), (build("mixtral"), _folded(1, 3, tp=3))])


def test_autoep_errors_are_raised_on_every_rank():
    for messages in run_ranks(_errors, 2):
        experts, world, pattern, none, ep_one, data_first, presets, offload, folded_experts, coeff = messages
        assert "autoep_size=2 does not divide num_experts=3 of MoE block 'model.layers.0.mlp'" in experts
        assert "'expert_parallel.autoep_size': 4 does not divide the world size 2" in world
        assert "AutoEP: no MoE block in the model matches Mixtral's layout with the expert_parallel patterns" in pattern
        assert "'model\\\\.blocks\\\\.\\\\d+\\\\.moe'" in pattern
        assert "AutoEP: no MoE block in the model matches Mixtral's layout:" in none
        assert "'expert_parallel.autoep_size': 1 and 'tensor_parallel.autotp_size': 2" in ep_one
        assert "needs autoep_size > 1" in ep_one
        assert "'use_data_before_expert_parallelism': true with 'expert_parallel.autoep_size': 2 and" in data_first
        assert "'tensor_parallel.preset_model': 'mixtral' and 'expert_parallel.preset_model': 'qwen3_moe'" in presets
        assert "NotSupportedError" in offload and "'zero_optimization.offload_optimizer.device': 'cpu'" in offload
        assert "autoep_size=2 does not divide num_experts=3 of MoE block 'model.layers.0.mlp'" in folded_experts
        assert "load_balance_coeff=0.01 is not supported" in coeff
