"""The parity matrix: ZeRO stages 0-3 vs a single-process PyTorch reference (gradient accumulation, parameters
not divisible by the world size; the reported global grad norm equals the reference's at every step, first
included, at every stage; a bucket larger than the model trains normally: the default buckets, 5e8 elements).

Each world size runs one ``run_ranks`` body holding many configurations (stage x precision x gradient
accumulation x clipping x overlap), on TinyNet (247 elements: every partition padded). Rank r != 0 perturbs its
initial weights, so parity also proves the initial broadcast. Stage 3 runs with persistence threshold 0 (every
unit gathered before use and released after) unless a spec says otherwise.

Tolerances:
* fp32: losses rtol 1e-6, grad norms rtol 1e-5, parameters atol 1e-6 / rtol 1e-5 (only the summation order of
  the cross-rank average differs from the reference's full-batch mean).
* bf16 (bf16 parameter storage and communication, fp32 compute, master and accumulation): losses rtol 5e-3
  (weights rounded to bf16, relative error 2^-8, perturb the loss at the 1e-4 level; measured <= 3e-4);
  grad norms rtol 3e-2 (gradients reduced in bf16); parameters atol 2 * lr * steps: AdamW moves each element by
  about lr per step whatever the gradient's size, so an element whose gradient is near zero can step the other
  way under bf16 noise (measured <= 2e-2 = 2 lr over 3 steps).
"""

import math
import pathlib
import sys

import pytest
import torch

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # parity_models, here and in the spawned ranks
import parity_models as pm  # noqa: E402

STAGES = (0, 1, 2, 3)
CLIP = 0.05  # below TinyNet's gradient norms (~0.1-0.5), so clipping really scales


def _matrix(world: int) -> list[dict]:
    specs = []
    if world == 1:
        specs += [dict(stage=s, gas=g) for s in STAGES for g in (1, 4)]
    elif world == 2:
        specs += [
            dict(stage=s, gas=g, clip=c, precision=p) for s in STAGES for g in (1, 4) for c in (None, CLIP)
            for p in ("fp32", "bf16")
        ]  # fmt: skip
        specs += [dict(stage=s, gas=4, zero={"overlap_comm": True}) for s in STAGES]
        specs += [dict(stage=s, gas=4, boundary=False) for s in STAGES]  # stages 0/1 reduce at step()
        specs += [dict(stage=3, gas=4, zero={"stage3_param_persistence_threshold": 50})]  # biases stay resident
        specs += [dict(stage=3, gas=1, zero={"stage3_prefetch_bucket_size": 10**6}, steps=4)]  # prefetch on
        # reduction pieces smaller than a bucket (DDP-sized buckets, launched as their gradients arrive): pieces
        # inside one rank's chunk and across chunk ends; bf16 pieces; stages 0/1 accumulating to the boundary
        specs += [dict(stage=s, gas=g, piece_bytes=160, zero={"overlap_comm": o}) for s in (0, 1, 2) for g in (1, 4)
                  for o in (True, False)]  # fmt: skip
        specs += [dict(stage=s, gas=4, piece_bytes=100, precision="bf16", clip=CLIP) for s in (0, 1, 2)]
        specs += [dict(stage=s, gas=4, piece_bytes=160, boundary=False) for s in (0, 1)]
    elif world == 3:
        specs += [dict(stage=s, gas=4, clip=CLIP, zero={"overlap_comm": True}) for s in STAGES]
        specs += [dict(stage=s, gas=1, precision="bf16") for s in STAGES]
        specs += [dict(stage=s, gas=4, zero={"reduce_bucket_size": 100}) for s in STAGES]  # several buckets
        specs += [dict(stage=s, gas=4, piece_bytes=120, zero={"reduce_bucket_size": 100}) for s in (0, 1, 2)]
    else:
        specs += [dict(stage=s, gas=1, clip=CLIP) for s in STAGES]
        specs += [dict(stage=s, gas=4, precision="bf16", zero={"reduce_bucket_size": 50}) for s in STAGES]
    for s in specs:
        s["world"] = world
        s.setdefault("steps", 3)
    return specs


def _body(specs):
    return [pm.sharded_run(s) for s in specs]


def _label(spec) -> str:
    keys = ("stage", "world", "gas", "clip", "precision", "zero", "boundary", "piece_bytes")
    return ", ".join(f"{k}={spec[k]}" for k in keys if k in spec)


def _check(spec, per_rank, ref):
    label = _label(spec)
    world = spec["world"]
    bf16 = spec.get("precision") == "bf16"
    loss_rtol, norm_rtol = (5e-3, 3e-2) if bf16 else (1e-6, 1e-5)
    p_atol, p_rtol = (2 * 1e-2 * spec["steps"], 0) if bf16 else (1e-6, 1e-5)
    for step, ref_loss in enumerate(ref["losses"]):
        loss = sum(r["losses"][step] for r in per_rank) / world
        assert math.isclose(loss, ref_loss, rel_tol=loss_rtol), f"{label}: step {step} loss {loss} vs {ref_loss}"
        for rank, r in enumerate(per_rank):
            assert r["norms"][step] == per_rank[0]["norms"][step], f"{label}: rank {rank} norm differs from rank 0"
        norm = per_rank[0]["norms"][step]
        assert math.isclose(norm, ref["norms"][step], rel_tol=norm_rtol), (
            f"{label}: step {step} grad norm {norm} vs reference {ref['norms'][step]}"
        )
    for name, want in ref["params"].items():
        for rank, r in enumerate(per_rank):
            got = r["params"][name]
            assert got.shape == want.shape, f"{label}: {name} shape {tuple(got.shape)} vs {tuple(want.shape)}"
            torch.testing.assert_close(got, want, atol=p_atol, rtol=p_rtol, msg=lambda m, n=name: f"{label}: {n}: {m}")
            assert torch.equal(got, per_rank[0]["params"][name]), f"{label}: rank {rank} {name} differs from rank 0"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_matrix(world):
    specs = _matrix(world)
    results = run_ranks(_body, world, specs, timeout=120)
    for i, spec in enumerate(specs):
        _check(spec, [r[i] for r in results], pm.reference_run(spec))
    # Stages agree with each other: same configuration, different stage.
    by_config = {}
    for i, spec in enumerate(specs):
        if spec.get("precision", "fp32") == "fp32":
            key = _label({k: v for k, v in spec.items() if k != "stage"})
            by_config.setdefault(key, []).append(results[0][i])
    for key, runs in by_config.items():
        for other in runs[1:]:
            for name, p in runs[0]["params"].items():
                torch.testing.assert_close(other["params"][name], p, atol=1e-6, rtol=1e-5, msg=f"{key}: {name}")


def test_clipping_is_effective():
    """The clip threshold used above really changes the reference (so 'clip on' tests clipping)."""
    a = pm.reference_run(dict(world=2, stage=0, steps=2))
    b = pm.reference_run(dict(world=2, stage=0, steps=2, clip=CLIP))
    assert min(a["norms"]) > CLIP
    assert not torch.allclose(a["params"]["l1.weight"], b["params"]["l1.weight"], atol=1e-6)
