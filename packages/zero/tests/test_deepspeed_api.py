"""DeepSpeed 0.19.8's public names through ``import zero as deepspeed``, each checked by value on 2 gloo ranks.

Every name listed as supported in ``zero.compat.names.SUPPORTED`` must be exercised here (the bodies return the
names they used); the README's compatibility table is generated from the same lists and compared.
References: a plain single-process PyTorch model with the same seed and data (fp32, tolerance 1e-6 relative).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import re

import pytest
import torch
from torch import nn

from zero_comm.testing import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
TOL = {"rtol": 1e-6, "atol": 1e-7}


class Head(nn.Module):
    """Reads a weight it does not own (the first layer's), as tied heads do: needs register_external_parameter."""

    def __init__(self, borrowed: nn.Parameter):
        super().__init__()
        self.borrowed = [borrowed]  # a list, so it is not registered as this module's parameter
        self.out = nn.Linear(7, 3)

    def forward(self, h):
        return self.out(h + self.borrowed[0].sum(dim=1)[:7])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(5, 9)  # 54 elements: divides by no world size > 1 except 2... with l2 and head: padded
        self.l2 = nn.Linear(9, 7)
        self.head = Head(self.l1.weight)

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _net() -> Net:
    torch.manual_seed(1234)
    return Net()


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * step + rank))


def _cfg(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
    }


def _close(a, b) -> bool:
    return torch.allclose(a.float(), b.float(), **TOL)


def _reference_grads(world: int, step: int) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The plain model and its gradient of the mean over ranks of each rank's mean loss (what ZeRO reduces)."""
    ref = _net()
    loss = sum(ref(_batch(r, step)).square().mean() for r in range(world)) / world
    loss.backward()
    return ref, {n: p.grad.clone() for n, p in ref.named_parameters()}


COMM_NAMES = [
    f"deepspeed.comm.{n}"
    for n in (
        "init_distributed",
        "is_initialized",
        "get_rank",
        "get_world_size",
        "get_local_rank",
        "all_reduce",
        "ReduceOp",
        "all_gather",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "barrier",
        "all_gather_object",
        "broadcast_object_list",
        "reduce",
        "send",
        "recv",
        "isend",
        "irecv",
    )
]


def comm_body() -> dict:
    import zero as deepspeed

    dc = deepspeed.comm
    dc.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    out = {
        "init": dc.is_initialized(),
        "rank": dc.get_rank(),
        "world": dc.get_world_size(),
        "local": dc.get_local_rank() == int(os.environ.get("LOCAL_RANK", "0")),
    }
    rank = dc.get_rank()
    t = torch.tensor([float(rank + 1)])
    dc.all_reduce(t)
    out["sum"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dc.all_reduce(t, op=dc.ReduceOp.MAX)
    out["max"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dc.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    out["min"] = t.item()
    t = torch.tensor([float(rank + 1)])
    dc.all_reduce(t, dc.ReduceOp.AVG, None, True).wait()
    out["avg_async"] = t.item()
    lst = [torch.zeros(2) for _ in range(2)]
    dc.all_gather(lst, torch.full((2,), float(rank)))
    out["gather"] = [x.tolist() for x in lst]
    b = torch.tensor([10.0 * rank])
    dc.broadcast(b, src=1)
    out["bcast"] = b.item()
    flat = torch.zeros(4)
    dc.all_gather_into_tensor(flat, torch.full((2,), float(rank + 1)))
    out["agit"] = flat.tolist()
    rs = torch.zeros(2)
    dc.reduce_scatter_tensor(rs, torch.arange(4.0) + rank)
    out["rs"] = rs.tolist()
    a2a = torch.zeros(2)
    dc.all_to_all_single(a2a, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    out["a2a"] = a2a.tolist()
    summed, averaged = torch.tensor([float(rank + 1)]), torch.tensor([float(rank + 1)])
    dc.reduce(summed, dst=0)
    dc.reduce(averaged, 1, dc.ReduceOp.AVG, None, True).wait()
    out["reduce"] = (summed.item(), averaged.item())
    dc.barrier()
    objs = [None, None]
    dc.all_gather_object(objs, {"rank": rank, "tag": "x" * (rank * 100)})  # unequal pickled sizes
    out["objs"] = objs
    lst = [f"from {rank}", rank, None]
    dc.broadcast_object_list(lst, src=1)
    out["bobj"] = lst
    try:
        dc.all_gather_object([None], 1)
    except ValueError as e:
        out["bad_list"] = str(e)
    uneven = torch.zeros(3 if rank == 0 else 2)  # rank 0 sends 1 row to itself, 2 to rank 1; rank 1 2 to rank 0
    sizes_in, sizes_out = ([1, 2], [1, 2]) if rank == 0 else ([2, 0], [2, 0])
    dc.all_to_all_single(uneven, torch.arange(3.0) if rank == 0 else torch.tensor([10.0, 11.0]),
                         sizes_out, sizes_in)  # fmt: skip
    out["a2a_uneven"] = uneven.tolist()
    peer = 1 - rank
    box = torch.zeros(2)
    if rank == 0:
        dc.send(torch.tensor([1.0, 2.0]), dst=peer, tag=3)
        out["recv_from"] = dc.recv(box, src=peer, tag=4)
    else:
        out["recv_from"] = dc.recv(box, src=peer, tag=3)
        dc.send(box * 10, dst=peer, tag=4)
    out["p2p"] = box.tolist()
    inbox = torch.zeros(1)
    handles = [dc.isend(torch.tensor([float(rank + 5)]), peer), dc.irecv(inbox, peer)]
    for h in handles:
        h.wait()
    out["ip2p"] = inbox.item()
    try:
        dc.recv(torch.zeros(1))
    except ValueError as e:
        out["any_sender"] = str(e)
    try:
        _ = dc.gather
    except deepspeed.NotSupportedError as e:
        out["refused"] = str(e)
    out["used"] = sorted(COMM_NAMES)
    return out


def test_comm_values_on_two_ranks():
    r0, r1 = run_ranks(comm_body, 2, timeout=60)
    for r, out in enumerate((r0, r1)):
        assert out["init"] and out["rank"] == r and out["world"] == 2 and out["local"]
        assert (out["sum"], out["max"], out["min"], out["avg_async"]) == (3.0, 2.0, 1.0, 1.5)
        assert out["gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["bcast"] == 10.0
        assert out["agit"] == [1.0, 1.0, 2.0, 2.0]
        assert out["a2a"] == [0.0 + r, 10.0 + r]
        assert out["objs"] == [{"rank": 0, "tag": ""}, {"rank": 1, "tag": "x" * 100}]
        assert out["bobj"] == ["from 1", 1, None]
        assert "1 slots" in out["bad_list"] and "2 ranks" in out["bad_list"]
        assert "gather" in out["refused"] and "all_gather" in out["refused"]
        assert out["recv_from"] == 1 - r and out["ip2p"] == float(6 - r)
        assert "src=None" in out["any_sender"]
    assert r0["p2p"] == [10.0, 20.0] and r1["p2p"] == [1.0, 2.0]
    assert r0["a2a_uneven"] == [0.0, 10.0, 11.0] and r1["a2a_uneven"] == [1.0, 2.0]
    assert r0["rs"] == [1.0, 3.0] and r1["rs"] == [5.0, 7.0]  # [0,1,2,3] + [1,2,3,4], chunk per rank
    assert r0["reduce"][0] == 3.0 and r1["reduce"][1] == 1.5  # the sum into rank 0, the mean into rank 1
    assert set(r0["used"]) == set(COMM_NAMES)


def engine_body(stage: int, tmp: str) -> dict:
    import safetensors.torch

    import zero as deepspeed
    from zero.as_deepspeed.utils import zero_to_fp32

    used: set[str] = set()
    out: dict = {}
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    cfg = _cfg(stage)
    used |= {"deepspeed.init_distributed"}

    # argparse + config objects
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    out["args"] = (args.deepspeed, args.deepspeed_config)
    dsc = deepspeed.DeepSpeedConfig(cfg)
    out["dsc"] = (dsc.train_batch_size, dsc.zero_optimization_stage, dsc.gradient_accumulation_steps)
    used |= {"deepspeed.add_config_arguments", "deepspeed.DeepSpeedConfig"}

    # zero.Init (DeepSpeed's keywords), GatheredParameters, register_external_parameter
    with deepspeed.zero.Init(
        config_dict_or_path=cfg,
        remote_device="cpu",
        pin_memory=False,
        enabled=stage == 3,
        data_parallel_group=None,
        mpu=None,
        dtype=None,
    ):
        model = _net()
    ref0 = _net()
    out["partitioned"] = all(p.numel() == 0 for p in model.parameters()) if stage == 3 else None
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        out["gathered_equal"] = all(_close(p, q) for p, q in zip(model.parameters(), ref0.parameters()))
    deepspeed.zero.register_external_parameter(model.head, model.l1.weight)
    used |= {"deepspeed.zero.Init", "deepspeed.zero.GatheredParameters", "deepspeed.zero.register_external_parameter"}
    from zero.as_deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # where TRL imports it from

    status = getattr(model.l1.weight, "ds_status", None)  # only partitioned parameters carry ds_* names
    out["ds_status"] = status is (ZeroParamStatus.NOT_AVAILABLE if stage == 3 else None)
    out["ds_status"] &= ZeroParamStatus is deepspeed.zero.ZeroParamStatus
    used |= {"deepspeed.zero.ZeroParamStatus", "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus"}

    engine, optimizer, _, sched = deepspeed.initialize(model=model, config=cfg)
    used |= {"deepspeed.initialize"}
    out["engine_type"] = isinstance(engine, deepspeed.DeepSpeedEngine)
    out["engine_attrs"] = (
        engine.module is model,
        engine.optimizer is optimizer,
        engine.lr_scheduler is sched,
        engine.zero_optimization_stage(),
        engine.gradient_accumulation_steps(),
        engine.train_micro_batch_size_per_gpu(),
        engine.train_batch_size(),
        engine.local_rank == int(os.environ.get("LOCAL_RANK", "0")),
        str(engine.device),
    )
    used |= {
        f"DeepSpeedEngine.{n}"
        for n in (
            "module",
            "optimizer",
            "lr_scheduler",
            "zero_optimization_stage",
            "gradient_accumulation_steps",
            "train_micro_batch_size_per_gpu",
            "train_batch_size",
            "local_rank",
            "device",
        )
    }
    used.add("deepspeed.DeepSpeedEngine")

    # one step: full and local gradients against the dense reference
    ref, ref_grads = _reference_grads(world, 0)
    loss = engine(_batch(rank, 0)).square().mean()
    engine.backward(loss)
    u = deepspeed.utils
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    grads = {n: u.safe_get_full_grad(params[n]) for n in names}
    out["full_grad"] = all(_close(grads[n], ref_grads[n]) for n in names)
    out["full_fp32_before"] = all(_close(u.safe_get_full_fp32_param(params[n]), p) for n, p in ref.named_parameters())
    local = {n: u.safe_get_local_grad(params[n]) for n in names}
    pieces = {n: [torch.zeros(0)] * world for n in names}
    for n in names:
        sizes = [torch.zeros(1) for _ in range(world)]
        deepspeed.comm.all_gather(sizes, torch.tensor([float(local[n].numel())]))
        buf = torch.zeros(int(max(s.item() for s in sizes)))
        buf[: local[n].numel()] = local[n]
        gathered = [torch.zeros_like(buf) for _ in range(world)]
        deepspeed.comm.all_gather(gathered, buf)
        pieces[n] = torch.cat([g[: int(s.item())] for g, s in zip(gathered, sizes)])
    out["local_grad"] = all(_close(pieces[n], ref_grads[n].reshape(-1)) for n in names)
    out["boundary"] = engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(False)
    out["boundary_forced"] = engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)
    used |= {
        "deepspeed.utils.safe_get_full_grad",
        "deepspeed.utils.safe_get_full_fp32_param",
        "deepspeed.utils.safe_get_local_grad",
        "DeepSpeedEngine.is_gradient_accumulation_boundary",
        "DeepSpeedEngine.set_gradient_accumulation_boundary",
    }
    if stage >= 2:
        try:
            with engine.no_sync():
                pass
        except AssertionError as e:
            out["no_sync"] = str(e)
        used.add("DeepSpeedEngine.no_sync")
    engine.step()

    # the same step on the reference: torch AdamW at the schedule's starting lr, warmup_min_lr 0.0 (WarmupLR writes
    # it when built, as DeepSpeed 0.19.8), so only the moments move; iteration 0's lr, 0.0, follows
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.0, weight_decay=0.0)
    ref_opt.step()
    out["norm"] = abs(engine.get_global_grad_norm() - torch.nn.utils.get_total_norm(list(ref_grads.values())).item())
    out["lr"] = engine.get_lr()
    out["steps"] = (engine.global_steps, engine.global_samples)
    out["fp32_after"] = all(_close(u.safe_get_full_fp32_param(params[n]), p) for n, p in ref.named_parameters())
    out["exp_avg"] = all(
        _close(u.safe_get_full_optimizer_state(params[n], "exp_avg"), ref_opt.state[p]["exp_avg"])
        for n, p in ref.named_parameters()
    )
    used |= {
        "DeepSpeedEngine.get_global_grad_norm",
        "DeepSpeedEngine.get_lr",
        "DeepSpeedEngine.global_steps",
        "DeepSpeedEngine.global_samples",
        "deepspeed.utils.safe_get_full_optimizer_state",
    }

    # setters: full and local, read back (and the model's own copy follows the fp32 master)
    w = params["l2.weight"]
    new = torch.linspace(-1, 1, 63).view(7, 9)
    u.safe_set_full_fp32_param(w, new)
    with deepspeed.zero.GatheredParameters(w):
        out["set_full_param"] = _close(u.safe_get_full_fp32_param(w), new) and _close(w, new)
    u.safe_set_full_optimizer_state(w, new * 2, "exp_avg")
    out["set_full_state"] = _close(u.safe_get_full_optimizer_state(w, "exp_avg"), new * 2)
    mine = u.safe_get_local_fp32_param(w)
    u.safe_set_local_fp32_param(w, mine + 1)
    out["set_local_param"] = _close(u.safe_get_local_fp32_param(w), mine + 1)
    out["local_param_is_piece"] = _close(
        mine, new.reshape(-1)[: mine.numel()] if rank == 0 else new.reshape(-1)[63 - mine.numel() :]
    )
    state = u.safe_get_local_optimizer_state(w, "exp_avg")
    u.safe_set_local_optimizer_state(w, state * 3, "exp_avg")
    out["set_local_state"] = _close(u.safe_get_local_optimizer_state(w, "exp_avg"), state * 3)
    engine.backward(engine(_batch(rank, 1)).square().mean())
    u.safe_set_full_grad(w, torch.ones(7, 9))
    out["set_full_grad"] = _close(u.safe_get_full_grad(w), torch.ones(7, 9))
    lg = u.safe_get_local_grad(w)
    u.safe_set_local_grad(w, torch.full_like(lg, 2.0))
    out["set_local_grad"] = _close(u.safe_get_local_grad(w), torch.full_like(lg, 2.0))
    engine.zero_grad()
    used |= {
        f"deepspeed.utils.{n}"
        for n in (
            "safe_set_full_fp32_param",
            "safe_set_full_optimizer_state",
            "safe_set_full_grad",
            "safe_get_local_fp32_param",
            "safe_set_local_fp32_param",
            "safe_get_local_optimizer_state",
            "safe_set_local_optimizer_state",
            "safe_set_local_grad",
        )
    }

    # checkpoints: save, change, load (module only / everything), zero_to_fp32, 16-bit model
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["save_returned"] = engine.save_checkpoint(tmp, tag="t1")
    engine.backward(engine(_batch(rank, 2)).square().mean())
    engine.step()
    engine.load_checkpoint(tmp, tag="t1", load_module_only=True)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["load_module_only"] = all(_close(p, saved[n]) for n, p in model.named_parameters())
    path, _ = engine.load_checkpoint(tmp, tag="t1", load_optimizer_states=True, load_lr_scheduler_states=True)
    out["load_steps"] = engine.global_steps
    out["load_path"] = os.path.relpath(path, tmp)
    full = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp, tag="t1")
    out["zero_to_fp32"] = all(_close(full[n], saved[n]) for n in saved)
    if rank == 0:
        written = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            tmp, os.path.join(tmp, "fp32"), tag="t1", safe_serialization=True
        )
        loaded = safetensors.torch.load_file(written)
        out["convert"] = all(_close(loaded[n], saved[n]) for n in saved)
        plain = zero_to_fp32.load_state_dict_from_zero_checkpoint(Net(), tmp, tag="t1")
        out["load_plain"] = all(_close(p, saved[n]) for n, p in plain.named_parameters())
    out["save_16bit_returned"] = engine.save_16bit_model(os.path.join(tmp, "w16"))
    weights = safetensors.torch.load_file(os.path.join(tmp, "w16", "model.safetensors"))
    out["save_16bit"] = all(_close(weights[n], saved[n]) for n in saved)
    state16 = engine._zero3_consolidated_16bit_state_dict()
    out["consolidated"] = (rank != 0 and state16 == {}) or all(_close(state16[n], saved[n]) for n in saved)
    used |= {
        "DeepSpeedEngine.save_checkpoint",
        "DeepSpeedEngine.load_checkpoint",
        "DeepSpeedEngine.save_16bit_model",
        "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
        "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
        "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    }

    # cache control and leaf modules (their effect is checked in test_stage3_branch_cache.py / test_moe_leaf.py)
    engine.empty_partition_cache()
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["after_empty_cache"] = all(_close(p, saved[n]) for n, p in model.named_parameters())
    probe = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    marked = deepspeed.utils.set_z3_leaf_modules(probe, [nn.Linear])
    listed = deepspeed.utils.get_z3_leaf_modules(probe)
    flag = deepspeed.utils.z3_leaf_module(probe[0]) and not deepspeed.utils.z3_leaf_module(probe[1])
    deepspeed.utils.unset_z3_leaf_modules(probe, ["Linear"])
    out["leaf"] = marked == listed == [probe[0]] and flag and deepspeed.utils.get_z3_leaf_modules(probe) == []
    used |= {
        "DeepSpeedEngine.empty_partition_cache",
        "deepspeed.utils.set_z3_leaf_modules",
        "deepspeed.utils.get_z3_leaf_modules",
        "deepspeed.utils.z3_leaf_module",
        "deepspeed.utils.unset_z3_leaf_modules",
    }

    closed = []
    engine.runtime.close = lambda: closed.append(True)  # the core's close() (another branch) is what destroy calls
    engine.destroy()
    out["destroy"] = closed == [True]
    used.add("DeepSpeedEngine.destroy")
    out["used"] = sorted(used)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_names_match_dense_reference(stage, tmp_path):
    results = run_ranks(engine_body, 2, stage, str(tmp_path), timeout=180)
    for rank, out in enumerate(results):
        assert out["args"] == (True, "ds.json")
        assert out["dsc"] == (8, stage, 1)
        assert out["partitioned"] is (True if stage == 3 else None)
        assert out["gathered_equal"] and out["ds_status"]
        assert out["engine_type"]
        assert out["engine_attrs"] == (True, True, True, stage, 1, 4, 8, True, "cpu")
        assert out["full_grad"] and out["full_fp32_before"] and out["local_grad"]
        assert out["boundary"] is True and out["boundary_forced"] is False
        if stage >= 2:
            assert f"ZeRO stage {stage}" in out["no_sync"]
        assert out["norm"] < 1e-5
        assert out["lr"] == [pytest.approx(0.0)] and out["steps"] == (1, 8)
        assert out["fp32_after"] and out["exp_avg"]
        for key in (
            "set_full_param",
            "set_full_state",
            "set_local_param",
            "local_param_is_piece",
            "set_local_state",
            "set_full_grad",
            "set_local_grad",
            "load_module_only",
            "zero_to_fp32",
            "save_16bit",
            "consolidated",
            "after_empty_cache",
            "leaf",
            "destroy",
        ):
            assert out[key], key
        assert out["load_steps"] == 1 and out["save_returned"] is True
        assert out["load_path"] == "t1/mp_rank_00_model_states.safetensors", out["load_path"]
        assert out["save_16bit_returned"] is True  # DeepSpeed's return value
        from zero.compat.names import SUPPORTED

        expected = {n for n in SUPPORTED if n.startswith(("DeepSpeedEngine.", "deepspeed.utils."))} | ENGINE_NAMES
        assert set(out["used"]) == expected - {"DeepSpeedEngine.compile"}  # compile: stages 0-2, tested below
        if rank == 0:
            assert out["convert"] and out["load_plain"]


ENGINE_NAMES = {
    "deepspeed.init_distributed",
    "deepspeed.add_config_arguments",
    "deepspeed.DeepSpeedConfig",
    "deepspeed.zero.Init",
    "deepspeed.zero.GatheredParameters",
    "deepspeed.zero.register_external_parameter",
    "deepspeed.zero.ZeroParamStatus",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    "deepspeed.initialize",
    "deepspeed.DeepSpeedEngine",
}


def stage1_body(use_no_sync: bool) -> dict:
    import zero as deepspeed

    cfg = {**_cfg(1), "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4}
    engine, _, _, _ = deepspeed.initialize(model=_net(), config=cfg)
    rank = deepspeed.comm.get_rank()
    if use_no_sync:  # Accelerate's pattern: local accumulation inside no_sync, the boundary outside
        with engine.no_sync():
            engine.backward(engine(_batch(rank, 0)).square().mean())
            with pytest.raises(AssertionError, match="inside no_sync"):  # DeepSpeed's refusal
                engine.step()
            inside = engine.global_steps
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(_batch(rank, 1)).square().mean())
        engine.step()
        engine.set_gradient_accumulation_boundary(None)
    else:
        for step in range(2):
            engine.backward(engine(_batch(rank, step)).square().mean())
            engine.step()
        inside = 0
    x = _batch(rank, 5)
    eager = engine(x).detach()
    engine.compile(backend="eager")
    compiled = engine(x).detach()
    return {
        "inside": inside,
        "steps": engine.global_steps,
        "params": [p.detach().clone() for p in engine.module.parameters()],
        "compiled": engine.is_compiled and torch.equal(eager, compiled),
    }


def test_no_sync_accumulates_locally_and_compile_matches_eager():
    with_ns = run_ranks(stage1_body, 2, True, timeout=120)
    plain = run_ranks(stage1_body, 2, False, timeout=120)
    for a, b in zip(with_ns, plain):
        assert a["inside"] == 0 and a["steps"] == b["steps"] == 1  # no optimizer step inside no_sync
        assert all(_close(p, q) for p, q in zip(a["params"], b["params"]))
        assert a["compiled"] and b["compiled"]


def stage3_compile_body():
    """Two engines from one initial model at ZeRO-3, one compiled by ``engine.compile()`` after its first step."""
    import zero as deepspeed

    rank = deepspeed.comm.get_rank()
    losses, params = {}, {}
    for compiled in (False, True):
        engine, _, _, _ = deepspeed.initialize(model=_net(), config=_cfg(3))
        run = []
        for step in range(3):
            if compiled and step == 1:
                engine.compile(backend="eager")
                first = engine._forward
                engine.compile(backend="eager")  # a second call keeps the first compilation
                assert engine._forward is first and engine.is_compiled
            loss = engine(_batch(rank, step)).square().mean()
            engine.backward(loss)
            engine.step()
            run.append(loss.item())
        losses[compiled] = run
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params[compiled] = [p.detach().clone() for p in engine.module.parameters()]
        engine.destroy()
    return {"losses": losses, "params": params}


def test_engine_compile_at_stage3_trains_as_the_eager_engine():
    """DeepSpeed's ``engine.compile()`` at ZeRO-3, as its compile tutorials call it after ``initialize``: the
    compiled engine's losses and gathered parameters equal the eager engine's over 3 steps on 2 ranks (fp32, the
    module's tolerance)."""
    for r in run_ranks(stage3_compile_body, 2, timeout=240):
        assert r["losses"][True] == pytest.approx(r["losses"][False], rel=1e-6)
        assert all(_close(p, q) for p, q in zip(r["params"][True], r["params"][False]))
        assert r["losses"][True][2] != r["losses"][True][0]  # it trained


def test_local_names_by_value():
    """Ops, profiler, accelerator, estimators, activation checkpointing: single process, no process group."""
    import zero as deepspeed

    used = set()
    fp = deepspeed.profiling.flops_profiler
    assert fp.get_model_profile(nn.Linear(256, 128), input_shape=(1, 256), as_string=False, print_profile=False) == (
        65664,
        32768,
        32896,
    )
    assert fp.get_model_profile(
        nn.Linear(256, 128), args=[torch.ones(1, 256)], print_profile=False, warm_up=0, ignore_modules=[nn.ReLU]
    ) == ("65.66 K", "32.77 KMACs", "32.9 K")
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    prof = fp.FlopsProfiler(model)
    prof.start_profile()
    model(torch.ones(3, 8))
    assert prof.get_total_macs() == 3 * (8 * 4 + 4 * 2) and prof.get_total_params() == 8 * 4 + 4 + 4 * 2 + 2
    # 2 x 120 MACs + 18 bias additions + 12 ReLU comparisons; DeepSpeed's format keeps the empty unit's space
    assert prof.get_total_flops(as_string=True) == "270 " and prof.get_total_duration() > 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        prof.print_model_profile(profile_step=1)
    assert "Linear" in buf.getvalue()
    prof.end_profile()
    used |= {"deepspeed.profiling.flops_profiler.get_model_profile", "deepspeed.profiling.flops_profiler.FlopsProfiler"}

    # DeepSpeed's optimizers against torch's AdamW / Adam (DeepSpeed's weight_decay default is 0)
    for cls, kwargs, ref_cls in (
        (deepspeed.ops.adam.DeepSpeedCPUAdam, {}, torch.optim.AdamW),
        (deepspeed.ops.adam.FusedAdam, {}, torch.optim.AdamW),
        (deepspeed.ops.adam.DeepSpeedCPUAdam, {"adamw_mode": False}, torch.optim.Adam),
        (deepspeed.ops.adam.FusedAdam, {"adam_w_mode": False}, torch.optim.Adam),
    ):
        torch.manual_seed(0)
        a, b = nn.Parameter(torch.randn(37)), None
        b = nn.Parameter(a.detach().clone())
        opt, ref = cls([a], lr=0.1, **kwargs), ref_cls([b], lr=0.1, weight_decay=0.0)
        for _ in range(3):
            g = torch.randn(37)
            a.grad, b.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), cls.__name__
    with pytest.raises(deepspeed.NotSupportedError, match="amsgrad"):
        deepspeed.ops.adam.DeepSpeedCPUAdam([nn.Parameter(torch.ones(2))], amsgrad=True)
    used |= {"deepspeed.ops.adam.DeepSpeedCPUAdam", "deepspeed.ops.adam.FusedAdam"}

    acc = deepspeed.accelerator.get_accelerator()
    expect = "cuda" if torch.cuda.is_available() else "cpu"
    assert acc.device_name() == expect and acc.current_device_name().startswith(expect) and acc.is_available()
    assert acc.communication_backend_name() == ("nccl" if expect == "cuda" else "gloo")
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(7)
    first = torch.rand(3)
    torch.manual_seed(7)
    assert expect == "cuda" or torch.equal(first, torch.rand(3))
    assert acc.memory_allocated() >= 0
    used.add("deepspeed.accelerator.get_accelerator")

    big = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))  # 1,011,010 params; largest layer 1,001,000
    for fn, stage in (
        (deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live, 2),
        (deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live, 3),
    ):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rows = fn(big, num_gpus_per_node=2)
        text = buf.getvalue()
        assert "1 node, 2 GPUs per node" in text and "Model with 1M total params" in text
        n, largest = 1_011_010, 1_001_000
        # ZeRO paper's per-device model states, no offload: 2 bytes 16-bit params + 16 bytes sharded (stage 2),
        # 18 bytes sharded + 4 bytes of the largest layer (stage 3)
        per_gpu = (2 * n + 16 * n / 2) if stage == 2 else (18 * n / 2 + 4 * largest)
        assert rows[1][1] == pytest.approx(per_gpu / 2**30) and f"{per_gpu / 2**30:6.2f}GB" in text
    used |= {
        "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
        "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    }

    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    y = deepspeed.checkpointing.checkpoint(lin, x)
    y.sum().backward()
    assert torch.equal(y, lin(x)) and x.grad is not None
    used.add("deepspeed.checkpointing.checkpoint")
    z = deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint(lin, x)  # DeepSpeed's own module path
    assert torch.equal(z, y)
    used.add("deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint")
    assert deepspeed.tp_model_init(lin, 2, torch.float32) is lin  # records; initialize() splits the model
    used.add("deepspeed.tp_model_init")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    want = net(x)
    engine = deepspeed.init_inference(net, {"dtype": "fp32"}, max_tokens=16)  # one process: tp_size 1
    assert isinstance(engine, deepspeed.InferenceEngine) and engine.module is net and torch.equal(engine(x), want)
    assert deepspeed.inference.engine.InferenceEngine is deepspeed.InferenceEngine
    cfg = deepspeed.inference.config.DeepSpeedInferenceConfig(mp_size=2, dtype="bf16")
    assert (cfg.tensor_parallel.tp_size, cfg.dtype, cfg.max_out_tokens) == (2, torch.bfloat16, 1024)
    used |= {"deepspeed.init_inference", "deepspeed.InferenceEngine", "deepspeed.inference.engine.InferenceEngine",
             "deepspeed.inference.config.DeepSpeedInferenceConfig"}  # fmt: skip
    hybrid, *_ = deepspeed.initialize(model=nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1,
                                                                     "hybrid_engine": {"enabled": True}})  # fmt: skip
    assert isinstance(hybrid, deepspeed.DeepSpeedHybridEngine)
    assert deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine is deepspeed.DeepSpeedHybridEngine
    with pytest.raises(TypeError, match="not a transformers model"):  # generate needs config and generate
        hybrid.generate(torch.ones(1, 2, dtype=torch.long))
    used |= {"deepspeed.DeepSpeedHybridEngine", "deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine"}
    assert used == set(LOCAL_NAMES)


LOCAL_NAMES = [
    "deepspeed.profiling.flops_profiler.get_model_profile",
    "deepspeed.profiling.flops_profiler.FlopsProfiler",
    "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adam.FusedAdam",
    "deepspeed.accelerator.get_accelerator",
    "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",
    "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",
    "deepspeed.checkpointing.checkpoint",
    "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint",
    "deepspeed.tp_model_init",
    "deepspeed.init_inference",
    "deepspeed.InferenceEngine",
    "deepspeed.inference.engine.InferenceEngine",
    "deepspeed.inference.config.DeepSpeedInferenceConfig",
    "deepspeed.DeepSpeedHybridEngine",  # trained and generating: test_hybrid_engine.py
    "deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine",
]


def test_supported_names_resolve_and_are_all_tested():
    import zero as deepspeed
    from zero.compat.names import SUPPORTED

    tested = set(COMM_NAMES) | set(LOCAL_NAMES) | ENGINE_NAMES
    tested |= {n for n in SUPPORTED if n.startswith(("DeepSpeedEngine.", "deepspeed.utils."))}
    assert set(SUPPORTED) == tested
    for name in SUPPORTED:
        obj = deepspeed.DeepSpeedEngine if name.startswith("DeepSpeedEngine.") else deepspeed
        attrs = name.split(".")[1:]
        if name.startswith("DeepSpeedEngine.") and attrs[0] in ("global_steps", "global_samples", "lr_scheduler"):
            continue  # instance attributes, checked by value in engine_body
        for attr in attrs:
            obj = getattr(obj, attr)
        assert obj is not None, name


def test_unsupported_names_raise_not_supported_naming_an_alternative():
    import zero as deepspeed
    from zero.compat import UnsupportedName
    from zero.compat.names import NOT_YET

    for name in NOT_YET:
        *path, last = name.split(".")[1:]
        obj = deepspeed
        for attr in path:
            obj = getattr(obj, attr)
        with pytest.raises(deepspeed.NotSupportedError) as err:
            getattr(obj, last)
        assert isinstance(err.value, UnsupportedName) and name in str(err.value) and "; " in str(err.value)
        assert not hasattr(obj, last)  # libraries probing with hasattr() see "absent", not a crash
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = deepspeed.comm.no_such_name


def test_zero_init_keywords():
    import zero as deepspeed

    with pytest.raises(deepspeed.NotSupportedError, match="mpu"):
        deepspeed.zero.Init(mpu=object())
    with pytest.raises(deepspeed.NotSupportedError, match="remote_device='nvme'"):
        deepspeed.zero.Init(remote_device="nvme")
    with pytest.raises(deepspeed.ConfigError, match="config_dict_or_path"):
        deepspeed.zero.Init(config={}, config_dict_or_path={})
    with pytest.raises(deepspeed.ConfigError, match="bf16.enabled"):
        deepspeed.zero.Init(config_dict_or_path={"bf16": {"enabled": "auto"}})
    from zero.partitioning.init import _dtype_from_config

    assert _dtype_from_config({"bf16": {"enabled": True}}) == torch.bfloat16
    assert _dtype_from_config({"bfloat16": {"enabled": True}}) == torch.bfloat16
    assert _dtype_from_config({"fp16": {"enabled": True}}) == torch.float16
    assert _dtype_from_config({"train_batch_size": 8}) == torch.float32 and _dtype_from_config(None) is None


def test_readme_compatibility_table_is_generated_from_the_lists():
    """The README section between the markers is ``status_table()``; ZERO_UPDATE_COMPAT=1 rewrites it."""
    from zero.compat.names import status_table

    text = README.read_text()
    begin, end = (
        "<!-- compat-table: generated by packages/zero/tests/test_deepspeed_api.py -->",
        "<!-- /compat-table -->",
    )
    assert begin in text and end in text, "README.md lacks the compatibility table markers"
    want = f"{begin}\n{status_table()}\n{end}"
    current = re.search(re.escape(begin) + r".*?" + re.escape(end), text, re.S).group(0)
    if os.environ.get("ZERO_UPDATE_COMPAT") == "1":
        README.write_text(text.replace(current, want))
        current = want
    assert current == want, "README's compatibility table is stale: run this test with ZERO_UPDATE_COMPAT=1"


def test_config_accepts_what_transformers_passes_and_reads():
    """transformers' Trainer sets steps_per_print to inf and reads engine.config like a dict (DeepSpeed's dict)."""
    from zero.config import load_config

    cfg = load_config({"train_batch_size": 2, "steps_per_print": float("inf"), "zero_optimization": {"stage": 3}})
    assert cfg.steps_per_print is None
    assert cfg.get("zero_optimization", {})["stage"] == 3 and cfg.get("no_such_section", "dflt") == "dflt"
