"""A team that moved a DeepSpeed run to zero can go back: with ``checkpoint.format: "deepspeed"`` zero's
``save_checkpoint`` writes DeepSpeed 0.19.8's ZeRO layout (``latest``, ``global_stepN/`` with the model-state and
per-rank ``*_optim_states.pt`` files DeepSpeed's ``load_checkpoint`` reads), at stages 1, 2 and 3, fp32 and bf16, on
two ranks. A fresh engine loads the folder (through zero's DeepSpeed reader) and the next steps on the same batches
equal the run that never stopped: the same losses and final parameters (relative 1e-6), the same step counter and
client state; also at another stage, with a weight frozen while its param group still lists it, and at stage 3
cut into sub-groups (``sub_group_size``) as DeepSpeed cuts them. Stage 0 is refused on every rank naming the key,
before anything is written; an unknown format is refused by the config naming the key. That the real DeepSpeed reads
these folders (and ``zero_to_fp32`` / ``ds_to_universal``) is checked by hand with
``fixtures/deepspeed_ckpt/check_deepspeed_reads_zero.py``.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import zero
from zero.checkpoint_tools.to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zero.config import ConfigError
from zero_comm.testing import run_ranks
from zero_core.checkpoint import CheckpointError
from zero_core.checkpoint.deepspeed_files import load_deepspeed_file

STEPS = 3


def _engine(stage: int, bf16: bool = False, seed: int = 5, fmt: str = "deepspeed", frozen: bool = False,
            sub_group_size: int | None = None, base: bool = False):  # fmt: skip
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if base:  # the frozen weight of a pretrained base every run starts from (seed 5's)
        net[0].weight.data.copy_(_engine_base_weight())
    net[0].weight.requires_grad_(not frozen)  # still listed by its param group: DeepSpeed's frozen parameter
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
                            lr=0.05, betas=(0.9, 0.99))  # fmt: skip
    zero_optimization = {"stage": stage, **({"sub_group_size": sub_group_size} if sub_group_size else {})}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": zero_optimization,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05,
                                                           "warmup_num_steps": 10}},
              "checkpoint": {"format": fmt}, **({"bf16": {"enabled": True}} if bf16 else {})}  # fmt: skip
    return zero.initialize(model=net, optimizer=opt, config=config)[0]


def _engine_base_weight() -> torch.Tensor:
    torch.manual_seed(5)
    return torch.nn.Linear(8, 16).weight.detach()


def _step(engine, step: int) -> float:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    dtype = next(engine.module.parameters()).dtype
    x, y = torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g).to(dtype)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _params(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.named_parameters())
    with zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().float().clone() for n, p in params}


def _round_trip(tmp: Path, stage: int, bf16: bool, load_stage: int, frozen: bool = False, sub: int = 0,
                exclude: bool = False) -> dict:  # fmt: skip
    folder = tmp / f"s{stage}{'_bf16' if bf16 else ''}_to{load_stage}{'_frozen' if frozen else ''}_{sub}_{exclude}"
    engine = _engine(stage, bf16, frozen=frozen, sub_group_size=sub or None, base=exclude)
    for step in range(STEPS):
        _step(engine, step)
    engine.save_checkpoint(str(folder), client_state={"epoch": 2}, exclude_frozen_parameters=exclude)
    at_save = _params(engine)
    # zero's zero_to_fp32 on the DeepSpeed layout: the fp32 masters (the module holds them cast to bf16)
    full = get_fp32_state_dict_from_zero_checkpoint(folder)
    fp32_equal = (
        set(full) <= set(at_save)
        and (exclude or set(full) == set(at_save))
        and all(
            full[n].dtype == torch.float32
            and torch.equal(full[n].to(torch.bfloat16).float() if bf16 else full[n], at_save[n])
            for n in full
        )
    )
    want = [_step(engine, step) for step in range(STEPS, 2 * STEPS)]
    # another seed: every value must come from the checkpoint (left out with exclude_frozen_parameters: the
    # frozen base weight, which the fresh model holds as the saved run did, and keeps)
    fresh = _engine(load_stage, bf16, seed=77, frozen=frozen, sub_group_size=sub or None, base=exclude)
    path, client = fresh.load_checkpoint(str(folder))
    loaded = fresh.global_steps
    got = [_step(fresh, step) for step in range(STEPS, 2 * STEPS)]
    a, b = _params(engine), _params(fresh)
    optim = sorted(folder.glob("global_step3/*optim_states.pt"))
    model_file = load_deepspeed_file(sorted(folder.glob("global_step3/*model_states.pt"))[0])
    holds_frozen = "0.weight" in model_file["module"] or bool(model_file["frozen_param_shapes"])
    flat_groups = len(load_deepspeed_file(optim[0])["optimizer_state_dict"].get("fp32_flat_groups", []))
    return {"flat_groups": flat_groups, "holds_frozen": holds_frozen,
            "files": sorted(p.name for p in (folder / "global_step3").iterdir()),
            "latest": (folder / "latest").read_text(), "script": (folder / "zero_to_fp32.py").is_file(),
            "fp32_equal": fp32_equal,
            "hidden": sorted(p.name for p in folder.iterdir() if p.name.startswith(".")),
            "path": str(Path(path).relative_to(folder)), "client": client.get("epoch"), "loaded_steps": loaded,
            "steps": fresh.global_steps,
            "losses": (want, got), "params_close": all(torch.allclose(b[n], a[n], rtol=1e-6, atol=1e-7) for n in a),
            "zero_stage": int(load_deepspeed_file(optim[0])["optimizer_state_dict"]["zero_stage"])}  # fmt: skip


def _global_step(engine, step: int) -> float:
    """One step on this rank's rows of a 12-row global batch; returns the global mean loss."""
    g = torch.Generator().manual_seed(100 * step)
    x, y = torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)
    rows = 12 // dist.get_world_size()
    mine = slice(dist.get_rank() * rows, (dist.get_rank() + 1) * rows)
    loss = torch.nn.functional.mse_loss(engine(x[mine]), y[mine])
    engine.backward(loss)
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _universal_engine(stage: int, fmt: str = "zero", seed: int = 5, load_universal: bool = False):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, betas=(0.9, 0.99), weight_decay=0.01)
    config = {"train_micro_batch_size_per_gpu": 12 // dist.get_world_size(), "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "scheduler": {"type": "WarmupLR", "params": {
                  "warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 10}},
              "checkpoint": {"format": fmt, "load_universal": load_universal}}  # fmt: skip
    return zero.initialize(model=net, optimizer=opt, config=config)[0]


def _write_universal(tmp: Path) -> dict:
    """Two ranks: write a universal checkpoint after three steps (stages 2 and 3), then run three more."""
    out = {}
    for stage in (2, 3):
        engine = _universal_engine(stage, "universal")
        for step in range(STEPS):
            _global_step(engine, step)
        engine.save_checkpoint(str(tmp / f"universal_s{stage}"), client_state={"epoch": 2})
        want = [_global_step(engine, step) for step in range(STEPS, 2 * STEPS)]
        folder = tmp / f"universal_s{stage}"
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        out[stage] = {"losses": want, "params": _params(engine), "files": files}
    return out


def _read_universal(tmp: str) -> dict:
    """Three ranks: load each universal folder (at stage 1 and at stage 3) and run the same three steps."""
    out = {}
    for stage in (2, 3):
        for load_stage in (1, 3):
            fresh = _universal_engine(load_stage, seed=77, load_universal=True)
            path, client = fresh.load_checkpoint(str(Path(tmp) / f"universal_s{stage}"))
            loaded = fresh.global_steps
            losses = [_global_step(fresh, step) for step in range(STEPS, 2 * STEPS)]
            where = Path(tmp) / f"universal_s{stage}"
            out[(stage, load_stage)] = {"path": str(Path(path).relative_to(where)), "client": client.get("epoch"),
                                        "loaded": loaded, "losses": losses, "params": _params(fresh)}  # fmt: skip
    return out


def _two_ranks(tmp: str) -> dict:
    tmp = Path(tmp)
    cases = [(1, False, 1), (2, False, 2), (3, False, 3), (2, True, 2), (3, True, 3), (1, False, 3)]
    cases += [(2, False, 2, True), (3, False, 3, True), (3, False, 3, False, 50)]
    # saved with exclude_frozen_parameters: the model files hold no frozen weight; the load keeps the module's
    cases += [(1, False, 1, True, 0, True), (2, False, 3, True, 0, True), (3, False, 2, True, 0, True)]
    out = {case: _round_trip(tmp, *case) for case in cases}
    stage0 = _engine(0)
    _step(stage0, 0)
    try:
        stage0.save_checkpoint(str(tmp / "stage0"))
        out["stage0"] = None
    except CheckpointError as e:
        out["stage0"] = (str(e), (tmp / "stage0" / "global_step1").exists())
    out["universal"] = _write_universal(tmp)
    return out


def _expected_files(stage: int, bf16: bool) -> list[str]:
    prefix = "bf16_" if bf16 else ""
    optim = [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    model = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)] if stage == 3 else [
        "mp_rank_00_model_states.pt"]  # fmt: skip
    return sorted(optim + model)


def test_a_run_goes_back_to_deepspeed_layout_and_universal_and_continues_from_it(tmp_path):
    results = run_ranks(_two_ranks, 2, str(tmp_path), timeout=300)
    for rank, out in enumerate(results):
        for (stage, bf16, load_stage, *rest), got in ((k, v) for k, v in out.items() if isinstance(k, tuple)):
            where = (rank, stage, bf16, load_stage, rest)  # rest: (frozen, sub_group_size, exclude_frozen)
            assert got["files"] == _expected_files(stage, bf16), (where, got["files"])
            # DeepSpeed's load_path: the model-states file its engine at load_stage reads (rank r's at stage 3)
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if load_stage == 3 and stage == 3 else (
                "mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt")  # fmt: skip
            assert got["latest"] == "global_step3" and got["path"] == f"global_step3/{name}", (where, got["path"])
            assert got["script"] and got["hidden"] == [], (where, got["hidden"])
            assert got["zero_stage"] == stage and got["client"] == 2, where
            assert got["loaded_steps"] == 3 and got["steps"] == 6, where
            want, losses = got["losses"]
            assert torch.allclose(torch.tensor(losses, dtype=torch.float64), torch.tensor(want, dtype=torch.float64),
                                  rtol=1e-6, atol=1e-7), (where, losses, want)  # fmt: skip
            assert got["params_close"], where
            assert got["fp32_equal"], where
            if rest[:1] == [True]:  # the frozen weight is in the model file unless left out
                assert got["holds_frozen"] == (rest[2:] != [True]), (where, got["holds_frozen"])
            if stage == 3:  # one sub-group per param group; three with sub_group_size 50 (64 + 32 + 10 elements)
                assert got["flat_groups"] == (3 if rest[1:] == [50] else 2), (where, got["flat_groups"])
        error, written = out["stage0"]
        assert "checkpoint.format 'deepspeed' writes ZeRO stages 1-3" in error and "stage 0" in error, (rank, error)
        assert not written, rank
    _check_universal(tmp_path, results[0]["universal"])
    # the zero_to_fp32.py copied beside a DeepSpeed-layout checkpoint converts it
    folder = tmp_path / "s2_to2_0_False"
    out = tmp_path / "consolidated.safetensors"
    run = subprocess.run([sys.executable, str(folder / "zero_to_fp32.py"), str(folder), str(out)], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    written, want = load_file(str(out)), get_fp32_state_dict_from_zero_checkpoint(folder)
    assert written.keys() == want.keys() and all(torch.equal(written[n], want[n]) for n in want)


def test_an_unknown_checkpoint_format_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"config key 'checkpoint.format': got 'torch'; Input should be 'zero', "
                       r"'deepspeed' or 'universal'"):  # fmt: skip
        zero.DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"format": "torch"}})


def _check_universal(tmp_path: Path, written: dict) -> None:
    """checkpoint.format "universal": the folder DeepSpeed's ds_to_universal makes, written by zero on two ranks at
    stages 2 and 3, loaded with checkpoint.load_universal on three ranks at stages 1 and 3: the same global batches
    give the losses and parameters of the run that never stopped."""
    read = run_ranks(_read_universal, 3, str(tmp_path), timeout=300)
    for stage, source in written.items():
        assert (tmp_path / f"universal_s{stage}" / "latest_universal").read_text() == "global_step3", stage
        names = ["0.weight", "0.bias", "2.weight", "2.bias"]
        want_files = sorted([f"global_step3/zero/{n}/{s}.pt" for n in names for s in ("fp32", "exp_avg", "exp_avg_sq",
                             "step")] + ["global_step3/mp_rank_00_model_states.pt",
                             "global_step3/zero/optimizer_state.pt", "latest_universal"])  # fmt: skip
        assert source["files"] == want_files, (stage, source["files"])
        fp32 = load_deepspeed_file(tmp_path / f"universal_s{stage}/global_step3/zero/0.weight/fp32.pt")
        assert fp32["param"].shape == (16, 8) and fp32["cat_dim"] == 0, stage
        for rank, out in enumerate(read):
            for load_stage in (1, 3):
                got, where = out[(stage, load_stage)], (rank, stage, load_stage)
                path = "global_step3/mp_rank_00_model_states.pt"  # the only model file of a universal folder
                assert got["path"] == path and got["client"] == 2 and got["loaded"] == 3, (where, got)
                assert torch.allclose(torch.tensor(got["losses"], dtype=torch.float64),
                                      torch.tensor(source["losses"], dtype=torch.float64), rtol=1e-6, atol=1e-7), (
                    where, got["losses"], source["losses"])  # fmt: skip
                for n, value in source["params"].items():
                    assert torch.allclose(got["params"][n], value, rtol=1e-6, atol=1e-7), (where, n)
