"""A model holding DeepSpeed MoE layers trains with initialize() at ZeRO 0-3 exactly as one process holding every
expert trains on the global batch: on 2 gloo ranks (ep_size 2: each rank holds half the experts; and ep_size 1)
and on 4 (ep_size 2: two ranks hold each expert, so expert gradients are reduced over the expert-data-parallel
group; and ep_size 4), every rank's loss and every parameter after each step equal the reference's (fp32, 1e-6),
also with the optimizer's parameters split into expert and other param groups (DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer``), whose non-expert flat groups are averaged over the
expert-parallel group after ZeRO's reduction.
No token is dropped (dropless gating). The loss adds each rank's ``l_aux``, which DeepSpeed computes over the
rank's own tokens, so the reference adds the l_aux of each rank's tokens likewise; it averages the ranks' losses
(the global-batch mean of the task loss, since every rank has as many tokens), and clips at DeepSpeed's default
gradient_clipping 1.0 (the norm counts every expert once, across ranks). Also: the configurations refused
with expert parallelism, an ep_size that does not divide the world, and the engine's MoE getters."""

import pytest
import torch
from safetensors.torch import load_file

import zero
from zero.checkpoint_tools.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero.config import NotSupportedError
from zero_comm.testing import run_ranks
from zero_parallel.moe import MoE, split_params_into_different_moe_groups_for_optimizer

M, E, T, STEPS = 6, 4, 8, 3  # hidden size, experts, tokens per rank, steps


class Net(torch.nn.Module):
    def __init__(self, ep_size: int, k: int, perturb: bool = True):
        super().__init__()
        torch.manual_seed(11)
        self.inp = torch.nn.Linear(M, M)
        expert = torch.nn.Sequential(torch.nn.Linear(M, 8), torch.nn.GELU(), torch.nn.Linear(8, M))
        self.moe = MoE(M, expert, num_experts=E, ep_size=ep_size, k=k, drop_tokens=False,
                       top2_2nd_expert_sampling=False)  # fmt: skip
        self.out = torch.nn.Linear(M, 1)
        experts = self.moe.deepspeed_moe.experts.deepspeed_experts
        first = _first_expert(ep_size)
        with torch.no_grad():  # expert g (global index) differs from the others, the same on every rank count
            for i, e in enumerate(experts if perturb else []):
                g = torch.Generator().manual_seed(100 + first + i)
                for p in e.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))

    def forward(self, x, y):
        h, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return torch.nn.functional.mse_loss(self.out(h), y) + 0.01 * l_aux


def _first_expert(ep_size: int) -> int:
    if ep_size == 1 or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank() % ep_size * (E // ep_size)


def _data(step: int, rank: int):
    g = torch.Generator().manual_seed(31 * step + rank)
    return torch.randn(T, M, generator=g), torch.randn(T, 1, generator=g)


def _cfg(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": T, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip


def _reference(world: int, k: int) -> list:
    """Per step: the ranks' losses and the parameters (experts under their global index)."""
    model = Net(1, k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses = [model(*_data(step, r)) for r in range(world)]
        (sum(losses) / world).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.nn.utils.get_total_norm(grads))
        opt.step()
        out.append(([loss.item() for loss in losses], {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


def _global_names(params: dict, first: int) -> dict:
    """``params`` with each local expert i renamed global expert first + i."""
    out, head = {}, "moe.deepspeed_moe.experts.deepspeed_experts."
    for name, value in params.items():
        if name.startswith(head):
            i, rest = name[len(head) :].split(".", 1)
            name = f"{head}{first + int(i)}.{rest}"
        out[name] = value
    return out


def _train(ep_size: int, k: int, stage: int, split: bool = False) -> list:
    model, cfg = Net(ep_size, k), _cfg(stage)
    opt = None
    if split:  # torch AdamW over an expert and a non-expert param group, as DeepSpeed's MoE examples build it
        groups = split_params_into_different_moe_groups_for_optimizer(
            [{"params": list(model.parameters()), "name": "params"}]
        )
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
        cfg = {key: value for key, value in cfg.items() if key != "optimizer"}
    engine, *_ = zero.initialize(model=model, optimizer=opt, config=cfg)
    rank, first, out = torch.distributed.get_rank(), _first_expert(ep_size), []
    for step in range(STEPS):
        loss = engine(*_data(step, rank))
        engine.backward(loss)
        engine.step()
        out.append((loss.item(), _global_names(engine.runtime.full_parameters(), first)))
    getters = (engine.has_moe_layers, engine.num_experts, sorted(engine.expert_data_parallel_group))
    engine.destroy()
    return [out, getters]


def _body(runs) -> list:
    return [_train(*run) for run in runs]


def _check(world: int, runs, results) -> None:
    refs = {k: _reference(world, k) for k in {run[1] for run in runs}}
    for rank, per_rank in enumerate(results):
        for (ep, k, stage, *split), (steps, getters) in zip(runs, per_rank):
            assert getters[:2] == (True, [E]) and f"ep_size_{ep}" in getters[2]  # the groups made so far
            for step, ((loss, params), (ref_losses, ref_params)) in enumerate(zip(steps, refs[k])):
                where = f"world {world} ep_size {ep} k {k} stage {stage} split groups {split} rank {rank} step {step}"
                assert loss == pytest.approx(ref_losses[rank], rel=1e-6, abs=1e-6), where
                for name, value in params.items():
                    torch.testing.assert_close(value, ref_params[name], rtol=1e-6, atol=1e-6, msg=f"{where}: {name}")


def test_expert_parallel_training_equals_one_process_on_two_ranks():
    runs = [(2, 1, 0), (2, 2, 1), (2, 1, 2), (2, 2, 3), (1, 1, 3), (2, 2, 2, True)]
    _check(2, runs, run_ranks(_body, 2, runs, timeout=300))


def test_expert_and_expert_data_parallel_training_equals_one_process_on_four_ranks():
    runs = [(2, 1, 0), (2, 2, 1), (2, 1, 2), (2, 2, 3), (4, 2, 3), (2, 1, 1, True), (4, 2, 2, True)]
    _check(4, runs, run_ranks(_body, 4, runs, timeout=300, threads=1))


def _refused() -> list:
    out = []
    for change in ({"gradient_allreduce_op": "sum"},):
        try:
            zero.initialize(model=Net(2, 1), config={**_cfg(1), **change})
        except NotSupportedError as exc:
            out.append(str(exc))
    try:
        zero.initialize(model=Net(4, 1), config=_cfg(1))  # 4 experts over 4 ranks, on 2
    except ValueError as exc:
        out.append(str(exc))
    engine, *_ = zero.initialize(model=Net(2, 1), config={**_cfg(1), "checkpoint": {"format": "deepspeed"}})
    try:
        engine.save_checkpoint("/nonexistent-moe-checkpoint")
    except NotSupportedError as exc:
        out.append(str(exc))
    engine.destroy()
    return out


def test_expert_parallel_errors_and_refusals_are_raised_on_every_rank():
    for messages in run_ranks(_refused, 2):
        assert len(messages) == 3 and "'gradient_allreduce_op'" in messages[0]
        assert "checkpoint.format 'deepspeed' with MoE layers (ep_size=2)" in messages[2]
        assert "ep_size=4 must be a positive integer dividing the world size 2" in messages[1]


def _step(engine, step: int) -> float:
    loss = engine(*_data(step, torch.distributed.get_rank()))
    engine.backward(loss)
    engine.step()
    return loss.item()


def _resume(root: str, stage: int) -> dict:
    """Train 2 steps, save, train a third; a new engine loads the save and trains the third step again."""
    path, cfg = f"{root}/stage{stage}", _cfg(stage)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True  # save_16bit_model writes at stage 3
    first, *_ = zero.initialize(model=Net(2, 2), config=cfg)
    for step in range(2):
        _step(first, step)
    first.save_checkpoint(path, client_state={"note": stage})
    first.save_16bit_model(f"{path}-16bit")  # every expert gathered, under its global name
    want_loss, want = _step(first, 2), _global_names(first.runtime.full_parameters(), _first_expert(2))
    first.destroy()
    again, *_ = zero.initialize(model=Net(2, 2), config=_cfg(stage))
    _, client = again.load_checkpoint(path)
    resumed = again.global_steps
    got_loss, got = _step(again, 2), _global_names(again.runtime.full_parameters(), _first_expert(2))
    again.destroy()
    wider, *_ = zero.initialize(model=Net(4, 2), config=_cfg(stage))  # every rank holds one expert
    _, wider_client = wider.load_checkpoint(path)
    wider_loss, wider_params = _step(wider, 2), _global_names(wider.runtime.full_parameters(), _first_expert(4))
    wider.destroy()
    whole, *_ = zero.initialize(model=Net(1, 2), config=_cfg(stage))  # every rank holds every expert
    whole.load_checkpoint(path)
    whole_loss, whole_params = _step(whole, 2), whole.runtime.full_parameters()
    whole.destroy()
    bitwise = got_loss == want_loss and all(torch.equal(got[n], want[n]) for n in want)
    return {"bitwise": bitwise, "client": client, "steps": resumed, "want": (want_loss, want),
            "wider": (wider_loss, wider_params, wider_client), "whole": (whole_loss, whole_params)}  # fmt: skip


def _resume_body(root: str) -> list:
    return [_resume(root, stage) for stage in (1, 3)]


def test_expert_parallel_checkpoint_resumes_bitwise(tmp_path):
    """4 ranks, ep_size 2: each expert-parallel rank's part written by its expert-data-parallel group and resumed
    bitwise; loaded at ep_size 4 and 1 (experts re-dealt, optimizer state included) the next step equals the ep_size
    2 run's; zero_to_fp32 gives the state dict of the one-process model holding
    every expert, equal to its parameters after the same 2 steps, and save_16bit_model at that step writes it."""
    results = run_ranks(_resume_body, 4, str(tmp_path), timeout=300, threads=1)
    for s, stage in enumerate((1, 3)):
        want = {}
        for per_rank in results:
            want.update(per_rank[s]["want"][1])  # every expert, under its global index
        for rank, per_rank in enumerate(results):
            res = per_rank[s]
            assert res["bitwise"] and res["steps"] == 2 and res["client"]["note"] == stage, (stage, rank)
            loss, params, client = res["wider"]
            assert client["note"] == stage and loss == pytest.approx(res["want"][0], rel=1e-6, abs=1e-6)
            for name, value in params.items():  # the third step at ep_size 4 equals the one at ep_size 2
                torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-6, msg=f"stage {stage}: {name}")
            loss, params = res["whole"]  # and at ep_size 1
            assert loss == pytest.approx(res["want"][0], rel=1e-6, abs=1e-6) and sorted(params) == sorted(want)
            for name, value in params.items():
                torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-6, msg=f"stage {stage}: {name}")
    names = sorted(p.name for p in (tmp_path / "stage1" / "global_step2").iterdir())
    assert names[:3] == ["ep_rank_00", "ep_rank_01", "expert_parallel.json"] and len(names) == 3 + E
    assert (tmp_path / "stage3" / "latest").read_text() == "global_step2"
    after_two = _reference(4, 2)[1][1]  # one process holding every expert, after 2 steps
    for stage in (1, 3):
        dense = get_fp32_state_dict_from_zero_checkpoint(tmp_path / f"stage{stage}")
        assert sorted(dense) == sorted(after_two)
        for name, value in after_two.items():
            torch.testing.assert_close(dense[name], value, rtol=1e-6, atol=1e-6, msg=f"stage {stage}: {name}")
        Net(1, 2).load_state_dict(dense)  # strict: the ep_size 1 model's keys
        written = load_file(str(tmp_path / f"stage{stage}-16bit" / "model.safetensors"))  # save_16bit_model's
        assert sorted(written) == sorted(dense) and all(torch.equal(written[n], dense[n]) for n in dense), stage
        for g in range(E):  # DeepSpeed's per-expert files: one per expert, global names
            saved = torch.load(
                tmp_path / f"stage{stage}" / "global_step2" / f"layer_0_expert_{g}_mp_rank_00_model_states.pt"
            )
            assert sorted(saved) == sorted(n for n in dense if f"deepspeed_experts.{g}." in n)
            assert all(torch.equal(saved[n], dense[n]) for n in saved)


def _built_under_zero_init(use_init: bool) -> list:
    config = _cfg(3)
    if use_init:
        with zero.zero.Init(config_dict_or_path=config):
            model = Net(2, 1, perturb=False)
    else:
        model = Net(2, 1, perturb=False)
    engine, *_ = zero.initialize(model=model, config=config)
    losses = [_step(engine, step) for step in range(STEPS)]
    engine.destroy()
    return losses


def _zero_init_body() -> list:
    return [_built_under_zero_init(False), _built_under_zero_init(True)]


def test_model_built_under_zero_init_trains_as_built_plainly():
    """ep_size 2 at stage 3: the parameters zero.Init partitioned over the world are made whole, then partitioned
    over the expert-data-parallel group; the losses equal those of the same model built without zero.Init."""
    for plain, under_init in run_ranks(_zero_init_body, 2):
        assert under_init == plain
