"""`zero.Init(config_dict_or_path=cfg)` judges the `zero_optimization` section as `initialize(config=cfg)` does, so a
model is never built under a config the engine then refuses (DeepSpeed #5917: a fractional
`stage3_prefetch_bucket_size` computed from a hidden size); keys still "auto" are left for transformers to fill."""

import torch

import zero
from zero.config import ConfigError
from zero_comm.testing import run_ranks


def _cfg(**zero_keys) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, **zero_keys}}  # fmt: skip


def _verdicts() -> dict:
    out = {}
    cases = {"fractional": {"stage3_prefetch_bucket_size": 3774873.6},
             "integral_float": {"stage3_prefetch_bucket_size": 3774873.0},
             "auto": {"stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto"},
             "typo": {"stage3_prefetch_bucket_sise": 100}}  # fmt: skip
    for name, keys in cases.items():
        cfg, verdict = _cfg(**keys), []
        try:
            with zero.zero.Init(config_dict_or_path=cfg):
                model = torch.nn.Linear(4, 3)
            verdict.append("accepted")
        except ConfigError as e:
            verdict.append(str(e))
            model = torch.nn.Linear(4, 3)
        if name != "auto":  # initialize itself needs "auto" filled (transformers does)
            try:
                zero.initialize(model=model, config=cfg)[0].destroy()
                verdict.append("accepted")
            except ConfigError as e:
                verdict.append(str(e))
        out[name] = verdict
    return out


def test_init_and_initialize_judge_a_config_alike():
    out = run_ranks(_verdicts, 1, timeout=120)[0]
    init, engine = out["fractional"]
    assert init == engine and "'zero_optimization.stage3_prefetch_bucket_size': got 3774873.6" in init
    assert out["integral_float"] == ["accepted", "accepted"]
    assert out["auto"] == ["accepted"]
    init, engine = out["typo"]
    assert init == engine and "stage3_prefetch_bucket_sise" in init
