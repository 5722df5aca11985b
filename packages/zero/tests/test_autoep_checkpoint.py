"""AutoEP checkpoints on 2 gloo ranks (autoep_size 2, ZeRO stages 1 and 3): a save after 2 steps resumes bitwise
at autoep_size 2, and loads at autoep_size 1 (every rank holding every expert: the fused expert tensors re-dealt,
optimizer state included) where the next step equals the autoep_size 2 run's; that run's save loads back at
autoep_size 2 (each rank its rows) and the next step equals the autoep_size 1 run's; ``zero_to_fp32`` gives the state
dict of the unconverted transformers model (its own names, whole expert tensors), which ``load_state_dict(strict=
True)`` and ``from_pretrained`` load, equal to the one-process model after the same 2 steps; ``save_16bit_model``
at the same step writes that dense model (every rank's experts gathered) and ``from_pretrained`` loads it, and the
consolidated state dict Accelerate's ``get_state_dict`` reads is that model too. Folded with AutoTP
(``tensor_parallel.autotp_size`` 2 on the same 2 ranks, stages 1 and 3) a save resumes bitwise at the same two
sizes, a load without AutoTP is refused on every rank naming both sizes, and ``zero_to_fp32`` gives the whole
transformers state dict (split attention rebuilt, experts stacked) equal to the one-process model trained on the
one batch the pair reads, as do ``save_16bit_model`` and the consolidated state dict."""

import os
import sys

import torch

import zero
from zero.checkpoint_tools.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from zero_comm.testing import run_ranks
from zero_core.checkpoint import CheckpointError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from autoep_models import build, config, data, local_rows, reference, tensor_parallel  # noqa: E402


def _step(engine, step: int) -> tuple[float, dict]:
    ids = data(step, torch.distributed.get_rank())
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item(), engine.runtime.full_parameters()


def _gathering(cfg: dict) -> dict:
    """``cfg`` with stage 3 told to gather the weights for ``save_16bit_model`` (the other stages always do)."""
    return {**cfg, "zero_optimization": {**cfg["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True}}


def _resume(root: str, stage: int) -> dict:
    path = f"{root}/stage{stage}"
    first, *_ = zero.initialize(model=build("mixtral"), config=_gathering(config(stage, 2)))
    for step in range(2):
        _step(first, step)
    first.save_checkpoint(path)
    first.save_16bit_model(f"{path}-16bit")
    consolidated = first._zero3_consolidated_16bit_state_dict()  # what Accelerate's get_state_dict calls at stage 3
    want = _step(first, 2)
    first.destroy()
    again, *_ = zero.initialize(model=build("mixtral"), config=config(stage, 2))
    again.load_checkpoint(path)
    got = _step(again, 2)
    again.destroy()
    whole, *_ = zero.initialize(model=build("mixtral"), config=config(stage, 1))
    whole.load_checkpoint(path)
    whole_step = _step(whole, 2)
    whole.save_checkpoint(f"{path}-whole")
    whole_next = _step(whole, 3)
    whole.destroy()
    split, *_ = zero.initialize(model=build("mixtral"), config=config(stage, 2))  # autoep_size 1 -> 2
    split.load_checkpoint(f"{path}-whole")
    split_next = _step(split, 3)
    split.destroy()
    bitwise = got[0] == want[0] and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    return {"bitwise": bitwise, "want": want, "whole": whole_step, "whole_next": whole_next, "split_next": split_next,
            "consolidated": consolidated}  # fmt: skip


def _folded_step(engine, step: int) -> tuple[float, dict]:
    ids = data(step, 0)  # the two ranks of the tensor-parallel group read one batch
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item(), engine.runtime.full_parameters()


def _folded_resume(root: str, stage: int) -> dict:
    path, cfg = f"{root}/folded{stage}", {**config(stage, 2), "tensor_parallel": tensor_parallel("mixtral", 2)}
    first, *_ = zero.initialize(model=build("mixtral"), config=_gathering(cfg))
    for step in range(2):
        _folded_step(first, step)
    first.save_checkpoint(path)
    first.save_16bit_model(f"{path}-16bit")
    consolidated = first._consolidated_16bit_state_dict()  # what Accelerate's get_state_dict calls under AutoTP
    want = _folded_step(first, 2)
    first.destroy()
    again, *_ = zero.initialize(model=build("mixtral"), config=cfg)
    again.load_checkpoint(path)
    got = _folded_step(again, 2)
    again.destroy()
    unfolded, *_ = zero.initialize(model=build("mixtral"), config=config(stage, 2))
    try:
        unfolded.load_checkpoint(path)
        refused = "no error"
    except CheckpointError as exc:
        refused = str(exc)
    unfolded.destroy()
    bitwise = got[0] == want[0] and all(torch.equal(got[1][n], want[1][n]) for n in want[1])
    return {"bitwise": bitwise, "refused": refused, "consolidated": consolidated}


def _body(root: str) -> list:
    return [_resume(root, stage) for stage in (1, 3)] + [_folded_resume(root, stage) for stage in (1, 3)]


def _same_as_16bit(dense: dict, folder, what: str) -> None:
    """``save_16bit_model``'s file (fp32 here: no bf16 section) holds the dense model ``zero_to_fp32`` rebuilt from
    the checkpoint saved at the same step, every expert of every rank included, and loads through
    ``from_pretrained``."""
    from safetensors.torch import load_file

    written = load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(dense), what
    for name, value in dense.items():
        assert torch.equal(written[name], value), f"{what}: {name}"
    loaded = type(build("mixtral")).from_pretrained(folder)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, dense[name]), f"{what}: {name} through from_pretrained"


def _same_as_consolidated(dense: dict, per_rank: list, what: str) -> None:
    """The consolidated state dict Accelerate's ``get_state_dict`` reads is the dense model on rank 0, {} elsewhere."""
    assert sorted(per_rank[0]) == sorted(dense) and all(not d for d in per_rank[1:]), what
    for name, value in dense.items():
        assert torch.equal(per_rank[0][name], value), f"{what}: {name} consolidated"


def test_autoep_checkpoint_resumes_bitwise_reshards_and_gives_the_dense_model(tmp_path):
    results = run_ranks(_body, 2, str(tmp_path), timeout=300)
    ref = reference("mixtral", 2, steps=2)[-1][1]  # the parameters after 2 steps
    folded_ref = reference("mixtral", 1, steps=2)[-1][1]  # one batch per step: the tensor-parallel pair's
    for s, stage in enumerate((1, 3)):
        for rank, per_rank in enumerate(results):
            got = per_rank[2 + s]
            assert got["bitwise"], f"folded stage {stage} rank {rank}"
            assert "saved at expert_parallel.autoep_size 2 and tensor_parallel.autotp_size 2" in got["refused"]
            assert "runs at autoep_size 2 and autotp_size 1" in got["refused"]
        dense = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / f"folded{stage}"))
        _same_as_16bit(dense, tmp_path / f"folded{stage}-16bit", f"folded stage {stage}")
        _same_as_consolidated(dense, [per_rank[2 + s]["consolidated"] for per_rank in results], f"folded {stage}")
        model = build("mixtral")
        model.load_state_dict(dense, strict=True)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, folded_ref[name], rtol=1e-6, atol=1e-6, msg=f"folded {stage}: {name}")
    for s, stage in enumerate((1, 3)):
        for rank, per_rank in enumerate(results):
            got = per_rank[s]
            assert got["bitwise"], f"stage {stage} rank {rank}"
            want_loss, want = got["want"]
            whole_loss, whole = got["whole"]
            assert abs(whole_loss - want_loss) <= 1e-6 * abs(want_loss), f"stage {stage} rank {rank}"
            for name, value in want.items():
                torch.testing.assert_close(local_rows(name, whole[name], 2, rank), value, rtol=1e-6, atol=1e-6)
            (whole_loss, whole), (split_loss, split) = got["whole_next"], got["split_next"]
            assert abs(split_loss - whole_loss) <= 1e-6 * abs(whole_loss), f"stage {stage} rank {rank}"
            for name, value in split.items():  # this rank's rows of the experts saved at autoep_size 1
                torch.testing.assert_close(value, local_rows(name, whole[name], 2, rank), rtol=1e-6, atol=1e-6)
        path = tmp_path / f"stage{stage}"
        dense = get_fp32_state_dict_from_zero_checkpoint(str(path))
        _same_as_16bit(dense, tmp_path / f"stage{stage}-16bit", f"stage {stage}")
        _same_as_consolidated(dense, [per_rank[s]["consolidated"] for per_rank in results], f"stage {stage}")
        model = build("mixtral")
        model.load_state_dict(dense, strict=True)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(value, ref[name], rtol=1e-6, atol=1e-6, msg=f"stage {stage}: {name}")
        out = tmp_path / f"hf{stage}"
        convert_zero_checkpoint_to_fp32_state_dict(str(path), str(out), safe_serialization=True)
        model.config.save_pretrained(out)
        loaded = type(model).from_pretrained(out)
        for name, value in loaded.state_dict().items():
            torch.testing.assert_close(value, ref[name], rtol=1e-6, atol=1e-6, msg=f"stage {stage}: {name}")
