"""save_checkpoint / load_checkpoint at their edges, as DeepSpeed's engine defines them (2 gloo ranks, one launch):
a folder with no `latest` loads nothing with a warning and (None, None); an empty save_dir is refused before anything
is written; tags that differ between ranks warn (`checkpoint.tag_validation: "Warn"`) and every rank saves under
rank 0's tag, or raise on every rank naming each rank's tag (`"Fail"`)."""

import os
import warnings

import pytest
import torch
import torch.distributed as dist

import zero
from zero_comm.testing import run_ranks


def _engine(tag_validation: str):
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "checkpoint": {"tag_validation": tag_validation},
    }
    engine = zero.initialize(model=net, config=cfg)[0]
    engine.backward(engine(torch.ones(2, 6)).square().mean())
    engine.step()
    return engine


def _edges(folder: str) -> dict:
    rank, out = dist.get_rank(), {}
    engine = _engine("WARN")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["empty_load"] = engine.load_checkpoint(os.path.join(folder, "nothing_here"))
    out["empty_load_warning"] = [str(w.message) for w in caught if "no checkpoint to load" in str(w.message)]
    here = os.getcwd()
    os.chdir(folder)  # where an empty save_dir would have written
    try:
        engine.save_checkpoint("")
    except ValueError as e:
        out["empty_dir_error"] = str(e)
    finally:
        os.chdir(here)
    dist.barrier()
    out["written_in_cwd"] = sorted(os.listdir(folder))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["saved_tag"] = engine.save_checkpoint(os.path.join(folder, "ckpt"), tag=f"tag_of_rank{rank}")
    out["tag_warning"] = [str(w.message) for w in caught if "different tags" in str(w.message)]
    out["tags_on_disk"] = sorted(p for p in os.listdir(os.path.join(folder, "ckpt")) if p.startswith("tag_"))
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    path, _ = engine.load_checkpoint(os.path.join(folder, "ckpt"))
    out["loaded"] = os.path.relpath(path, folder)
    out["same_params"] = all(torch.equal(before[n], p) for n, p in engine.module.named_parameters())
    strict = _engine("Fail")
    try:
        strict.save_checkpoint(os.path.join(folder, "strict"), tag=f"other{rank}")
    except ValueError as e:
        out["fail_error"] = str(e)
    out["strict_written"] = os.path.exists(os.path.join(folder, "strict", "latest"))
    return out


def test_checkpoint_calls_at_their_edges(tmp_path):
    for rank, out in enumerate(run_ranks(_edges, 2, str(tmp_path), timeout=240)):
        assert out["empty_load"] == (None, None) and len(out["empty_load_warning"]) == 1, (rank, out)
        assert "nothing_here/latest is missing" in out["empty_load_warning"][0]
        assert "save_dir is empty" in out["empty_dir_error"] and out["written_in_cwd"] == []  # nothing written
        assert out["saved_tag"] is True and out["tags_on_disk"] == ["tag_of_rank0"]  # DeepSpeed returns True
        assert "rank 0: 'tag_of_rank0', rank 1: 'tag_of_rank1'" in out["tag_warning"][0]
        assert out["loaded"] == "ckpt/tag_of_rank0/mp_rank_00_model_states.safetensors" and out["same_params"]
        assert "rank 0: 'other0', rank 1: 'other1'" in out["fail_error"] and "'Fail'" in out["fail_error"]
        assert not out["strict_written"]


def test_a_universal_folder_loaded_without_load_universal_names_the_key(tmp_path):
    from zero.engine.checkpoint_calls import latest_is_missing

    (tmp_path / "latest_universal").write_text("global_step3_universal")
    with pytest.warns(UserWarning, match="latest_universal: set checkpoint.load_universal: true"):
        assert latest_is_missing(tmp_path, None)
    (tmp_path / "latest").write_text("global_step3")
    assert not latest_is_missing(tmp_path, None)


def _new_optimizer_body(folder: str) -> dict:
    from torch import nn

    def build(two_groups: bool):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ps = list(net.parameters())
        groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}] if two_groups else [{"params": ps}]
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2}}
        return zero.initialize(model=net, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=config)[0]

    saved = build(True)
    saved.backward(saved(torch.randn(2, 4)).sum())
    saved.step()
    saved.save_checkpoint(folder, tag="t")
    fresh = build(False)  # the fine-tuning run: one param group
    out = {}
    for flags in ({}, {"load_module_only": True}, {"load_optimizer_states": False}):
        try:
            fresh.load_checkpoint(folder, tag="t", **flags)
        except Exception as e:  # noqa: BLE001 - the error is the result
            out[str(flags)] = str(e)
            continue
        want, got = saved.runtime.full_parameters(), fresh.runtime.full_parameters()
        out[str(flags)] = all(torch.equal(want[n], got[n]) for n in want)
    return out


def test_weights_load_into_a_run_with_other_param_groups_when_optimizer_states_are_not_loaded(tmp_path):
    for out in run_ranks(_new_optimizer_body, 2, str(tmp_path / "c"), timeout=120):
        assert "optimizer param group 1 in the checkpoint, 0 in the model" in out["{}"], out
        assert "start the optimizer afresh" in out["{}"], out
        assert out["{'load_module_only': True}"] is True and out["{'load_optimizer_states': False}"] is True, out
