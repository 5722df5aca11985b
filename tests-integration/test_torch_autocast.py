"""`torch_autocast` at ZeRO stages 0-3 on 2 ranks against a single-process ``torch.autocast`` run (bf16, and fp16
with ``torch.amp.GradScaler``); the same model, global batch and SGD.

Bound, and why: both runs compute every Linear in the autocast dtype, but the reference multiplies the whole
global batch at once while each rank multiplies its half, and the weight gradient of a low-precision matmul is
rounded to the autocast dtype once per sum: per rank here, once for the whole batch in the reference. So gradients
differ by about one rounding of the autocast dtype (bf16 2^-8 = 0.4%, fp16 2^-11 = 0.05% relative), and SGD moves
the parameters by lr x that. Stated bounds: losses rtol 1e-2 (bf16) / 5e-4 (fp16); parameters atol = lr x steps x
one rounding (2^-8 bf16, 2^-11 fp16) x the largest gradient seen, rtol 0. Measured (2 ranks, 4 steps, every stage
alike): bf16 loss 2.8e-3 relative, parameters 1.4e-4 (bound 1.0e-3); fp16 loss 1.0e-4, parameters 2.1e-5 (bound
1.3e-4).
The fp16 loss scale is checked to stay at 2^16 on both sides (no step skipped) and the same skip rule holds.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
from zero_comm.testing import run_ranks

MICRO, STEPS, LR = 4, 4, 0.1
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(12, 33), torch.nn.LayerNorm(33), torch.nn.GELU(),
                               torch.nn.Linear(33, 3))  # fmt: skip


def _batch(step, world):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(world * MICRO, 12, generator=g) * 0.3, torch.randn(world * MICRO, 3, generator=g) * 0.1


def _loss(out, y):
    return F.mse_loss(out.float(), y)


def reference(dtype_name: str, world: int):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    fp16 = dtype_name == "float16"
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    losses, gmax = [], 0.0
    for step in range(STEPS):
        x, y = _batch(step, world)
        with torch.autocast("cpu", dtype=DTYPES[dtype_name]):
            loss = _loss(model(x), y)
        opt.zero_grad()
        (scaler.scale(loss) if fp16 else loss).backward()
        if fp16:
            scaler.unscale_(opt)
        gmax = max(gmax, max(float(p.grad.abs().max()) for p in model.parameters()))
        if fp16:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(float(loss))
    scale = scaler.get_scale() if fp16 else None
    return losses, {n: p.detach() for n, p in model.named_parameters()}, gmax, scale


def _body():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype_name in DTYPES:
        for stage in (0, 1, 2, 3):
            cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0,
                   "torch_autocast": {"enabled": True, "dtype": dtype_name},
                   "optimizer": {"type": "SGD", "params": {"lr": LR}},
                   "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}  # fmt: skip
            engine = zero.initialize(model=_model(), config=cfg)[0]
            losses = []
            for step in range(STEPS):
                x, y = _batch(step, world)
                sl = slice(rank * MICRO, (rank + 1) * MICRO)
                loss = _loss(engine(x[sl]), y[sl])
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            scale = engine.runtime.loss_scaler.scale
            out[(dtype_name, stage)] = (losses, engine.runtime.full_parameters(), scale, engine.skipped_steps)
    return out


def test_autocast_matches_single_process_torch_autocast():
    world = 2
    results = run_ranks(_body, world, timeout=300)
    for dtype_name in DTYPES:
        ref_losses, ref_params, gmax, ref_scale = reference(dtype_name, world)
        bf16 = dtype_name == "bfloat16"
        loss_rtol, p_atol = (1e-2, LR * STEPS * 2**-8 * gmax) if bf16 else (5e-4, LR * STEPS * 2**-11 * gmax)
        for stage in (0, 1, 2, 3):
            label = f"{dtype_name} stage {stage}"
            per_rank = [r[(dtype_name, stage)] for r in results]
            for step in range(STEPS):
                mean = sum(r[0][step] for r in per_rank) / world
                assert mean == pytest.approx(ref_losses[step], rel=loss_rtol), f"{label} step {step}"
            for name, want in ref_params.items():
                torch.testing.assert_close(per_rank[0][1][name], want, rtol=0, atol=p_atol, msg=f"{label} {name}")
            if not bf16:
                assert per_rank[0][2] == ref_scale == 2.0**16 and per_rank[0][3] == 0, label
            else:
                assert per_rank[0][2] == 1.0, label  # bf16: no scaling


def test_autocast_with_bf16_section_is_rejected():
    from zero.config import NotSupportedError, load_config
    from zero.engine.autocast import check_autocast

    cfg = load_config({"train_batch_size": 1, "torch_autocast": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(NotSupportedError, match="'torch_autocast.enabled'.*'bf16.enabled'"):
        check_autocast(cfg)
    with pytest.raises(zero.ConfigError, match="torch_autocast.lower_precision_safe_modules"):
        load_config({"train_batch_size": 1, "torch_autocast": {"lower_precision_safe_modules": ["torch.nn.Lin"]}})
    with pytest.raises(zero.ConfigError, match="torch_autocast.dtype"):
        load_config({"train_batch_size": 1, "torch_autocast": {"dtype": "int8"}})
