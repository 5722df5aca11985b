"""``engine.offload_states()`` / ``reload_states()`` as RLHF frameworks call them between rollouts (OpenRLHF, with
DeepSpeed's enums from ``deepspeed.runtime.zero.offload_config``): the named states' memory is released (the bytes
of the stores' tensors, counted per storage), and training after the reload equals, bit for bit, a run that never
offloaded. Stages 2 and 3 on 2 ranks, bf16 (parameters, fp32 masters and optimizer state all distinct storages).
"""

from __future__ import annotations

import torch
from torch import nn

from zero_comm.testing import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(2, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


def _train(engine, rank: int, steps) -> list[float]:
    losses = []
    for step in steps:
        loss = engine(_batch(rank, step)).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _full(engine) -> list[torch.Tensor]:
    return [t for _, t in sorted(engine.runtime.full_parameters().items())]


def offload_body() -> dict:
    import zero
    from zero.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    rank = torch.distributed.get_rank()
    out = {}
    for stage in (2, 3):
        cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
        plain, *_ = zero.initialize(model=_model(), config=cfg)
        moved, *_ = zero.initialize(model=_model(), config=cfg)
        want = _train(plain, rank, range(4))
        got = _train(moved, rank, range(2))
        before = moved.runtime.model_state_bytes()
        # only the optimizer state first (the engine's call), then everything through the optimizer's own call
        moved.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu)
        only_state = moved.runtime.model_state_bytes()
        moved.reload_states()
        # OpenRLHF's call between rollouts: through the optimizer, reloaded through the engine
        kinds = [OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.contiguous_grad_buffer,
                 OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_grads]  # fmt: skip
        moved.optimizer.offload_states(include=kinds, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)
        moved.empty_partition_cache()
        rollout = moved.runtime.model_state_bytes()
        moved.reload_states(non_blocking=True)
        moved.offload_states()  # every kind, pin_memory=True: no pinning on CPU-only torch
        everything = moved.runtime.model_state_bytes()
        moved.optimizer.reload_states()
        after = moved.runtime.model_state_bytes()
        got += _train(moved, rank, range(2, 4))
        out[stage] = {"before": before, "only_state": only_state, "rollout": rollout, "everything": everything,
                      "after": after, "device_key": moved.config["zero_optimization"]["offload_optimizer"],
                      "losses": (want, got), "equal": all(torch.equal(a, b) for a, b in
                                                          zip(_full(plain), _full(moved)))}  # fmt: skip
        with_none = moved.offload_states(device=OffloadDeviceEnum.none)  # DeepSpeed: a warning, nothing moved
        out[stage]["none"] = (with_none, moved.runtime.model_state_bytes() == after)
        try:
            moved.offload_states(device="nvme")
        except ValueError as e:
            out[stage]["nvme"] = str(e)
    # refresh_fp32_params (DeepSpeed's ZeRO optimizer): 16-bit weights edited in place become the fp32 masters
    from zero.utils import safe_get_full_fp32_param

    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = zero.initialize(model=_model(), config=cfg)
    weight = engine.module[0].weight
    with torch.no_grad():
        weight.fill_(0.5)
    before = safe_get_full_fp32_param(weight).clone()
    engine.optimizer.refresh_fp32_params()
    out["refresh"] = (torch.equal(before, torch.full_like(before, 0.5)),
                      torch.equal(safe_get_full_fp32_param(weight), torch.full_like(before, 0.5)))  # fmt: skip
    return out


def test_offload_states_releases_memory_and_training_continues_bitwise():
    outs = run_ranks(offload_body, 2, timeout=240)
    for out in outs:
        for stage in (2, 3):
            o = out[stage]
            before = o["before"]
            assert min(before["params"], before["master"], before["optimizer"]) > 0, (stage, before)
            assert o["only_state"] == {**before, "optimizer": 0, "total": before["total"] - before["optimizer"]}
            assert o["rollout"] == {**before, "grads": 0, "master": 0, "optimizer": 0, "total": before["params"]}
            assert o["everything"] == {"params": 0, "grads": 0, "master": 0, "optimizer": 0, "total": 0}, stage
            assert o["device_key"] is None  # engine.config["zero_optimization"][...] as OpenRLHF reads it
            assert o["after"] == before
            want, got = o["losses"]
            assert got == want and o["equal"], stage  # bit for bit
            assert o["none"] == (None, True)
            assert "NVMe" in o["nvme"]
        assert out["refresh"] == (False, True)  # the master followed the edit only when refreshed
