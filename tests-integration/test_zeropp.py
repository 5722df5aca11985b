"""ZeRO++ inside stage 3 (qwZ, qgZ, hpZ) against plain stage 3 and the single-process reference.

Protocol: TinyNet, 4 gloo ranks, stage 3, prefetch on, persistence threshold 0, fp32, AdamW;
5 steps; a no_grad eval forward after step 2; a checkpoint saved after step 3 and loaded into a fresh runtime for
steps 4-5. Pure hpZ (2 nodes of 2) must equal plain stage 3 bitwise and the reference within 1e-6 at every step,
including the first step, the eval forward after an update and the first step after the reload.
qwZ + qgZ (int8, block 64): losses within rtol ``QUANT_RTOL`` of the reference, never 0 or NaN, ranks agreeing
bitwise on the gathered weights (eval logits identical on every rank).
"""

import math
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import parity_models as pm  # noqa: E402

WORLD, STEPS, EVAL_AFTER, SAVE_AFTER = 4, 5, 2, 3
TOL = 1e-6
# int8 weights and gradients with 64-element blocks: measured at most 4.2e-4 relative on TinyNet over 5 steps (with
# and without hpZ); 5e-2 is the case's documented bound, wide enough for other seeds and quantizers. hpZ alone: 8e-8.
QUANT_RTOL = 5e-2
BASE = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 1000}
HPZ = {"zero_hpz_partition_size": 2}
QUANT = {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zeropp_block_size": 64,
         "zeropp_gradient_bits": 8}  # fmt: skip


def _eval_batch():
    g = torch.Generator().manual_seed(99)
    return torch.rand(12, 8, generator=g) * 2 - 1, torch.randint(0, 4, (12,), generator=g)


def _reference() -> dict:
    model = pm.build("tiny")
    opt = pm.make_optimizer("adamw", model.parameters())
    losses, params = [], []
    for step in range(STEPS):
        x, y = pm.batch(step, WORLD, 1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if step + 1 == EVAL_AFTER:
            with torch.no_grad():
                ex, ey = _eval_batch()
                eval_loss = F.cross_entropy(model(ex), ey).item()
    return {"losses": losses, "params": params, "eval": eval_loss}


def _runtime(zero: dict):
    from zero_core import ZeroConfig, ZeroRuntime

    model = pm.build("tiny")
    return ZeroRuntime(model, pm.make_optimizer("adamw", model.parameters()), ZeroConfig(stage=3, **zero))


def _train_step(rt, step: int, rank: int) -> float:
    x, y = pm.batch(step, WORLD, 1)
    lo = rank * pm.MICRO_PER_RANK
    loss = F.cross_entropy(rt.module(x[lo : lo + pm.MICRO_PER_RANK]), y[lo : lo + pm.MICRO_PER_RANK])
    rt.backward(loss)
    rt.step()
    return loss.item()


def _zeropp_body(zero: dict, root: str) -> dict:
    import torch.distributed as dist

    from zero_comm import CommsLogger
    from zero_core.checkpoint import load_checkpoint, save_checkpoint

    rank = dist.get_rank()
    losses, params = [], []
    with CommsLogger() as log:
        rt = _runtime(zero)
        for step in range(STEPS):
            if step == SAVE_AFTER:  # a fresh runtime continues from the checkpoint
                save_checkpoint(rt, root, f"step{step}")
                rt = _runtime(zero)
                load_checkpoint(rt, root)
            losses.append(_train_step(rt, step, rank))
            params.append(rt.full_parameters())
            if step + 1 == EVAL_AFTER:
                with torch.no_grad():
                    ex, ey = _eval_batch()
                    logits = rt.module(ex)
                    eval_loss = F.cross_entropy(logits, ey).item()
    return {"losses": losses, "params": params, "eval": eval_loss, "logits": logits,
            "names": sorted({r.name for r in log.records})}  # fmt: skip


def _bad_hpz_body() -> str:
    try:
        _runtime({**BASE, "zero_hpz_partition_size": 3})
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("zeropp")
    configs = {"plain": BASE, "hpz": {**BASE, **HPZ}, "quant_hpz": {**BASE, **HPZ, **QUANT}, "quant": {**BASE, **QUANT}}
    out = {name: run_ranks(_zeropp_body, WORLD, zero, str(root / name), timeout=60) for name, zero in configs.items()}
    out["reference"] = _reference()
    return out


def _global_losses(results) -> list[float]:
    """Mean over ranks of each rank's micro-batch loss = the reference's full-batch loss (equal micro-batches)."""
    return [sum(r["losses"][s] for r in results) / len(results) for s in range(STEPS)]


def test_hpz_equals_plain_stage3_bitwise_and_the_reference(runs):
    plain, hpz, ref = runs["plain"], runs["hpz"], runs["reference"]
    for r_plain, r_hpz in zip(plain, hpz):
        assert r_hpz["losses"] == r_plain["losses"], "hpZ without quantization must not change numerics"
        assert r_hpz["eval"] == r_plain["eval"]
        for s in range(STEPS):
            for n, v in r_plain["params"][s].items():
                assert torch.equal(r_hpz["params"][s][n], v), f"step {s + 1}: {n} differs from plain stage 3"
    got = _global_losses(hpz)
    for s in range(STEPS):  # includes step 1, the step after the eval forward and step 4 (first after reload)
        assert got[s] == pytest.approx(ref["losses"][s], abs=TOL, rel=TOL), f"step {s + 1}"
        for n, v in ref["params"][s].items():
            torch.testing.assert_close(hpz[0]["params"][s][n], v, atol=TOL, rtol=TOL, msg=f"step {s + 1}: {n}")
    for r in hpz:
        assert r["eval"] == pytest.approx(ref["eval"], abs=TOL, rel=TOL), "eval forward after an update"


def test_hpz_collectives_are_used(runs):
    for r in runs["hpz"]:
        assert {"hpz_all_gather", "hpz_secondary_all_gather"} <= set(r["names"]), r["names"]
        assert not any(n.startswith(("qwz", "qgz")) for n in r["names"])
    assert not any(n.startswith(("hpz", "qwz", "qgz")) for n in runs["plain"][0]["names"])


@pytest.mark.parametrize("config", ["quant_hpz", "quant"])
def test_quantized_losses_within_tolerance(runs, config):
    results, ref = runs[config], runs["reference"]
    got = _global_losses(results)
    for s in range(STEPS):
        assert math.isfinite(got[s]) and got[s] != 0.0, f"step {s + 1}: loss {got[s]}"
        assert got[s] == pytest.approx(ref["losses"][s], rel=QUANT_RTOL), f"step {s + 1}"
    for r in results:  # every rank dequantizes every shard, its own included: identical weights everywhere
        assert torch.equal(r["logits"], results[0]["logits"])
        assert math.isfinite(r["eval"]) and r["eval"] == pytest.approx(ref["eval"], rel=QUANT_RTOL)
        assert "qwz_all_gather" in r["names"] and any(n.startswith("qgz") for n in r["names"]), r["names"]
    if config == "quant_hpz":
        assert {"hpz_secondary_all_gather", "qgz_all_to_all_intra", "qgz_all_to_all_inter"} <= set(results[0]["names"])
    worst = max(abs(g - e) / e for g, e in zip(got, ref["losses"]))
    assert worst > 0.0, "quantization on must change the losses somewhat (else it was not used)"


def test_zeropp_keys_require_stage3():
    from zero_core import ZeroConfig

    for key, value in [("zero_quantized_weights", True), ("zero_quantized_gradients", True),
                       ("zero_hpz_partition_size", 2)]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"{key}={value!r} requires stage 3.*got stage 2"):
            ZeroConfig(stage=2, **{key: value})
    with pytest.raises(ValueError, match="zeropp_block_size has an effect only with"):
        ZeroConfig(stage=3, zeropp_block_size=64)
    assert ZeroConfig(stage=3, zero_hpz_partition_size=2).zero_hpz_partition_size == 2


def test_hpz_size_must_divide_the_world():
    for msg in run_ranks(_bad_hpz_body, WORLD, timeout=60):
        assert "zero_hpz_partition_size=3 must divide the data-parallel world size 4" in msg
