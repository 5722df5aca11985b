"""A team moves a DeepSpeed run to zero mid-training: ``engine.load_checkpoint`` on DeepSpeed 0.19.8's own checkpoint
folder (stages 1, 2 and 3, two ranks, fp32 and bf16, torch AdamW in two param groups, WarmupLR, gradient clipping;
also with a frozen weight in no param group, and stage 3 cut into sub-groups) resumes the run, and the next steps on
the same batches give DeepSpeed's own continuation: the same losses on every rank, the same final parameters
(relative 1e-6), the same step counter and lr; also at another ZeRO stage, on one rank accumulating the two ranks'
micro-batches, and on three ranks, from the folder or from DeepSpeed's universal checkpoint of it
(``ds_to_universal``; also of the stage 3 folder), as DeepSpeed's three-rank continuation from the universal one.
Folders without ZeRO (stage 0: fp32, bf16) continue the same, and DeepSpeed's BF16_Optimizer's (reducing in bf16 as
it did); fp16 folders (stages 0-3, dynamic loss scale) give DeepSpeed's losses bit for bit and its loss scale, up to
the step where DeepSpeed unscales by the grown scale. ``load_checkpoint`` returns the model-states file DeepSpeed
names. A folder missing a rank's file, or holding a pickled type outside the allow-list, fails on every rank naming
the file (and the type) and changes nothing. The folders, DeepSpeed's continuations and the script that wrote them
(under the real DeepSpeed) are in ``fixtures/deepspeed_ckpt``; DeepSpeed is not needed here."""

import datetime
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero
from zero.engine import precision
from zero_comm.testing import run_ranks
from zero_core.checkpoint import CheckpointError
from zero_core.checkpoint.deepspeed_files import load_deepspeed_file
from zero_core.checkpoint.deepspeed_read import open_deepspeed
from zero_core.checkpoint.formats import open_deepspeed_folder

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_ckpt"


def _model() -> torch.nn.Module:
    torch.manual_seed(99)  # not DeepSpeed's seed: every value must come from the checkpoint
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _optimizer(net: torch.nn.Module, record: dict) -> torch.optim.Optimizer:
    o = record["optimizer"]
    weights = [p for n, p in net.named_parameters() if n.endswith("weight") and p.requires_grad]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias") and p.requires_grad]
    groups = [{"params": weights, "weight_decay": o["weight_decay"][0]},
              {"params": biases, "weight_decay": o["weight_decay"][1]}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"])


def _resume(folder: str, zero_stage: int, reference: str | None = None) -> dict:
    """Load DeepSpeed's checkpoint ``fixtures/deepspeed_ckpt/<folder>`` into zero at ``zero_stage`` and run the
    continuation batches DeepSpeed ran from ``reference`` (default: the same folder; the universal one holds the
    stage 2 checkpoint's state). On one rank the two ranks' micro-batches of a step are accumulated (the same global
    batch of 8)."""
    record = json.loads((FIXTURES / (reference or folder) / "continuation.json").read_text())
    world, rank = dist.get_world_size(), dist.get_rank()
    config = dict(record["config"], zero_optimization={"stage": zero_stage},
                  gradient_accumulation_steps=record["world_size"] // world)  # fmt: skip
    if reference not in (None, folder):
        config.pop("checkpoint", None)  # a plain folder loads from latest
    if folder.startswith("universal"):  # a universal folder loads from latest_universal
        config["checkpoint"] = {"load_universal": True}
    if config.get("data_types", {}).get("grad_accum_dtype") == "fp32":
        # DeepSpeed's BF16_Optimizer all-reduced its fp32 gradient buffers in its communication_data_type, bf16 by
        # default; zero reduces an explicit fp32 accumulation in fp32 at stages 0-1 unless told the dtype
        config["communication_data_type"] = "bf16"
    net = _model()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in record.get("frozen", []))
    if "fp16" in config:  # DeepSpeed's run computed in fp16 on this CPU: so does zero here (it would compute in fp32
        # on a CPU without fp16 matrix units)
        precision.NATIVE_CPU_FLAGS = {**precision.NATIVE_CPU_FLAGS, torch.float16: tuple(precision.cpu_flags())}
    engine = zero.initialize(model=net, optimizer=_optimizer(net, record), config=config)[0]
    path, client_state = engine.load_checkpoint(str(FIXTURES / folder))
    out = {"path": path, "global_steps_loaded": engine.global_steps,
           "global_samples_loaded": engine.global_samples, "ds_version": client_state.get("ds_version")}  # fmt: skip
    losses = {r: [] for r in range(record["world_size"]) if world == 1 or r == rank}
    dtype = next(engine.module.parameters()).dtype  # bf16 runs take bf16 inputs, as DeepSpeed's did
    for step in range(len(record["losses"][0])):
        for r in losses:
            x, y = record["batches"][r][step]
            loss = torch.nn.functional.mse_loss(engine(torch.tensor(x, dtype=dtype)), torch.tensor(y, dtype=dtype))
            engine.backward(loss)
            engine.step()
            losses[r].append(loss.item())
    params = list(engine.module.named_parameters())
    with zero.GatheredParameters([p for _, p in params]):
        out["params"] = {n: p.detach().float().reshape(-1).tolist() for n, p in params}
    out.update(losses=losses, global_steps=engine.global_steps, lr=engine.get_lr(),
               loss_scale=engine.optimizer.cur_scale, skipped_steps=engine.skipped_steps)  # fmt: skip
    return out


def _cases(cases: list[tuple]) -> list[dict]:
    return [_resume(*case) for case in cases]


def _close(a: list[float], b: list[float]) -> bool:
    return torch.allclose(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), rtol=1e-6,
                          atol=1e-7)  # fmt: skip


def _model_file(folder: str, zero_stage: int, rank: int) -> str:
    """The model-states file DeepSpeed 0.19.8's ``load_checkpoint`` returns for ``folder`` loaded at ``zero_stage``
    on ``rank``: ``zero_pp_rank_<rank>_...`` at stage 3 (rank 0's from a universal folder), else ``mp_rank_00_...``;
    a folder holding only the other stage's file (which DeepSpeed would not load) names the file it holds."""
    universal = folder.startswith("universal")
    tag = "global_step3_universal" if universal else "global_step3"
    pp = 0 if universal else rank
    names = [f"zero_pp_rank_{pp}_mp_rank_00_model_states.pt"] if zero_stage == 3 else []
    names += ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    name = next(n for n in names if (FIXTURES / folder / tag / n).is_file())
    return f"{FIXTURES / folder}/{tag}/{name}"


def _check(cases: list[tuple], results: list[list[dict]]) -> None:
    for i, (folder, zero_stage, *reference) in enumerate(cases):
        record = json.loads((FIXTURES / (reference or [folder])[0] / "continuation.json").read_text())
        for rank, by_case in enumerate(results):
            got = by_case[i]
            where = f"DeepSpeed {folder} -> zero stage {zero_stage} on {len(results)} ranks, rank {rank}"
            want_path = _model_file(folder, zero_stage, rank)
            assert got["path"] == want_path and got["global_steps_loaded"] == 3, (where, got["path"], want_path)
            assert got["global_samples_loaded"] == 24 and got["ds_version"] == "0.19.8", where
            fp16 = "fp16" in record["config"]
            for r, losses in got["losses"].items():
                if fp16:  # DeepSpeed unscales the gradients of a step where its dynamic scale grows by the grown
                    # scale (it updates the scale first): half the gradient at the continuation's second step at
                    # stages 1-3 (its first at stage 0, whose FP16_UnfusedOptimizer counts iterations apart), which
                    # zero unscales by the scale that made them. The losses before are DeepSpeed's bit for bit (the
                    # same run with a scale that does not grow continues bit for bit throughout); after, 2e-2 at
                    # stages 1-3, Adam amplifying the halved step
                    exact = 1 if record["stage"] == 0 else 2
                    assert losses[:exact] == record["losses"][r][:exact], (where, r, losses, record["losses"][r])
                    drift = torch.allclose(torch.tensor(losses), torch.tensor(record["losses"][r]), rtol=2e-2)
                    assert drift or record["stage"] == 0, (where, r, losses, record["losses"][r])
                    continue
                assert _close(losses, record["losses"][r]), (where, r, losses, record["losses"][r])
            assert got["global_steps"] == record["global_steps"] == 6, where
            assert got["skipped_steps"] == record.get("skipped_steps", 0), (where, got["skipped_steps"])
            if record.get("loss_scale") is not None:  # fp16: the dynamic scale went on from the saved one
                assert got["loss_scale"] == record["loss_scale"], (where, got["loss_scale"], record["loss_scale"])
            assert _close(got["lr"], record["lr"]), (where, got["lr"], record["lr"])
            assert sorted(got["params"]) == sorted(record["params"]), where
            for name, want in record["params"].items():
                assert fp16 or _close(got["params"][name], want), (where, name)  # fp16: Adam amplifies the drift


def _failed_load(engine, folder: Path) -> dict:
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    try:
        engine.load_checkpoint(str(folder))
        out = {"error": None}
    except CheckpointError as e:
        out = {"error": str(e)}
    out["params_kept"] = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    out["steps_kept"] = engine.global_steps == 0
    return out


def _edges(tmp: str) -> dict:
    """A DeepSpeed folder missing a rank's file, and one whose model file holds a type outside the allow-list: the
    load fails on every rank naming the file, nothing changes; an explicit tag loads."""
    tmp, rank = Path(tmp), dist.get_rank()
    if rank == 0:
        shutil.copytree(FIXTURES / "stage2", tmp / "missing")
        (tmp / "missing" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
        shutil.copytree(FIXTURES / "stage2", tmp / "foreign")
        model_file = tmp / "foreign" / "global_step3" / "mp_rank_00_model_states.pt"
        torch.save(dict(load_deepspeed_file(model_file), started=datetime.date(2026, 1, 1)), model_file)
    dist.barrier()
    record = json.loads((FIXTURES / "stage2" / "continuation.json").read_text())
    net = _model()
    engine = zero.initialize(model=net, optimizer=_optimizer(net, record), config=record["config"])[0]
    out = {"missing": _failed_load(engine, tmp / "missing"), "foreign": _failed_load(engine, tmp / "foreign")}
    path, _ = engine.load_checkpoint(str(FIXTURES / "stage2"), tag="global_step3")
    out["tagged"] = (path, engine.global_steps)
    # fine-tuning from a DeepSpeed run: the weights only, equal to DeepSpeed's own full fp32 values (ds_to_universal)
    net = _model()
    fresh = zero.initialize(model=net, optimizer=_optimizer(net, record), config=record["config"])[0]
    fresh.load_checkpoint(str(FIXTURES / "stage2"), load_module_only=True)
    full = FIXTURES / "universal" / "global_step3_universal" / "zero"
    out["module_only"] = {"steps": fresh.global_steps, "state": len(fresh.optimizer.state_dict()["state"]),
                          "equal": all(torch.equal(p, load_deepspeed_file(full / n / "fp32.pt")["param"])
                                       for n, p in _gathered(fresh).items())}  # fmt: skip
    return out


def _two_ranks(cases: list[tuple[str, int]], tmp: str) -> tuple[list[dict], dict]:
    return _cases(cases), _edges(tmp)


def test_zero_continues_a_deepspeed_run_from_its_checkpoint(tmp_path):
    # the same stage, and another stage on the same two ranks
    cases = [("stage1", 1), ("stage2", 2), ("stage3", 3), ("stage1", 3), ("stage3", 2)]
    cases += [("stage1_bf16", 1), ("stage2_bf16", 2), ("stage3_bf16", 3), ("stage2_frozen", 2), ("stage3_frozen", 3)]
    cases += [("stage1_frozen", 1)]
    cases += [("stage3_subgroups", 3)]
    results = run_ranks(_two_ranks, 2, cases, str(tmp_path), timeout=300)
    _check(cases, [continued for continued, _ in results])
    for rank, (_, edges) in enumerate(results):
        missing, foreign = edges["missing"], edges["foreign"]
        assert "lacks the optimizer states of ranks [1]" in missing["error"], (rank, missing)
        assert "mp_rank_00_model_states.pt" in foreign["error"] and "datetime.date" in foreign["error"], (rank, foreign)
        assert all(e["params_kept"] and e["steps_kept"] for e in (missing, foreign)), (rank, edges)
        assert edges["tagged"] == (f"{FIXTURES}/stage2/global_step3/mp_rank_00_model_states.pt", 3), rank
        assert edges["module_only"] == {"steps": 0, "state": 0, "equal": True}, (rank, edges["module_only"])


def test_zero_continues_deepspeed_runs_without_zero_in_fp16_and_from_stage3_universal():
    # stage 0 (fp32: torch's optimizer state; bf16 and fp16: DeepSpeed's fp16 optimizer with fp32 masters) and fp16
    # at stages 1-3 with a dynamic loss scale, at their own stage and at another
    cases = [("stage0", 0), ("stage0_bf16", 0), ("stage0_fp16", 0), ("stage1_fp16", 1), ("stage2_fp16", 2)]
    cases += [("stage3_fp16", 3), ("stage0", 3), ("stage0_fp16", 2), ("stage3_fp16", 1)]
    # bf16 with fp32 gradient accumulation at stage 1 (DeepSpeed's BF16_Optimizer: no zero_stage in its files)
    cases += [("stage1_bf16_optimizer", 1), ("stage1_bf16_optimizer", 3)]
    # ds_to_universal of the stage 3 folder (per-rank model files, the step kept in optimizer_state.pt)
    cases += [("universal_stage3", 3, "stage3"), ("universal_stage3", 2, "stage3")]
    _check(cases, run_ranks(_cases, 2, cases, timeout=300))


def test_zero_continues_a_two_rank_deepspeed_run_on_one_rank():
    cases = [("stage2", 2), ("stage3", 1)]
    _check(cases, run_ranks(_cases, 1, cases, timeout=300))


def _gathered(engine) -> dict[str, torch.Tensor]:
    params = list(engine.module.named_parameters())
    with zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().clone() for n, p in params}


def _universal_edges(tmp: str) -> dict:
    """``checkpoint.load_universal: true`` on a folder with neither ``latest_universal`` nor ``latest`` raises
    DeepSpeed's ValueError on every rank; on a folder zero wrote (only ``latest``) it loads that checkpoint, here at
    another stage."""
    record = json.loads((FIXTURES / "universal" / "continuation.json").read_text())
    engines = []
    for stage in (2, 3):
        net = _model()
        config = dict(record["config"], zero_optimization={"stage": stage})
        engines.append(zero.initialize(model=net, optimizer=_optimizer(net, record), config=config)[0])
    out = {}
    try:
        engines[0].load_checkpoint(str(Path(tmp) / "nothing_here"))
    except ValueError as e:
        out["empty_error"] = str(e)
    engines[0].load_checkpoint(str(FIXTURES / "universal"))
    engines[0].save_checkpoint(str(Path(tmp) / "written_by_zero"))
    path, _ = engines[1].load_checkpoint(str(Path(tmp) / "written_by_zero"))
    out["zero_path"] = path
    a, b = _gathered(engines[0]), _gathered(engines[1])
    out["same_params"] = all(torch.equal(a[n], b[n]) for n in a)
    return out


def _three_ranks(cases: list[tuple[str, int]], tmp: str) -> tuple[list[dict], dict]:
    return _cases(cases), _universal_edges(tmp)


def test_zero_continues_from_deepspeed_universal_checkpoint_on_three_ranks(tmp_path):
    # ds_to_universal of the two-rank stage 2 checkpoint; DeepSpeed's own continuation ran on three ranks. The
    # two-rank stage 2 folder itself, loaded on three ranks, continues the same way.
    cases = [("universal", 2), ("universal", 3), ("universal", 1), ("stage2", 3, "universal")]
    results = run_ranks(_three_ranks, 3, cases, str(tmp_path), timeout=300)
    _check(cases, [continued for continued, _ in results])
    for rank, (_, edges) in enumerate(results):
        assert "Invalid for universal checkpoint" in edges["empty_error"], (rank, edges)
        assert "nothing_here/latest_universal does not exist" in edges["empty_error"], (rank, edges)
        want = str(Path(tmp_path) / "written_by_zero" / "global_step3" / "mp_rank_00_model_states.safetensors")
        assert edges["zero_path"] == want and edges["same_params"], (rank, edges)


class _NotAllowed:
    """A type no DeepSpeed checkpoint holds: its file must be refused, never unpickled."""


def test_a_file_holding_another_pickled_type_is_refused_naming_file_and_type(tmp_path):
    folder = tmp_path / "global_step3"
    shutil.copytree(FIXTURES / "stage2" / "global_step3", folder)
    bad = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 2, "evil": _NotAllowed()}}, bad)
    with pytest.raises(CheckpointError) as err:
        load_deepspeed_file(bad)
    assert str(bad) in str(err.value) and "_NotAllowed" in str(err.value)
    assert isinstance(err.value.__cause__, pickle.UnpicklingError)


def test_a_model_parallel_deepspeed_folder_is_refused_naming_its_files(tmp_path):
    folder = tmp_path / "global_step3"
    shutil.copytree(FIXTURES / "stage2" / "global_step3", folder)
    (folder / "mp_rank_01_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError) as err:
        open_deepspeed(folder)
    assert "mp_rank_01_model_states.pt" in str(err.value) and "ds_to_universal" in str(err.value)


def test_a_stage0_folder_outside_an_engine_is_refused_naming_why():
    # its optimizer state names no parameter: it loads by position into a running optimizer only, as DeepSpeed's
    with pytest.raises(CheckpointError, match=r"without ZeRO \(stage 0\): its optimizer state names no parameter"):
        open_deepspeed_folder(FIXTURES / "stage0", None)
