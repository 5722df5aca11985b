"""Config keys from today's DeepSpeed documentation (0.19.x-0.20) and the checks DeepSpeed 0.19.8 makes on them,
as a user copying a current config would meet them: each accepted with DeepSpeed's meaning, or refused naming the
key and why. The base config is ``{"train_batch_size": 2, "optimizer": {"type": "Adam", ...}}`` plus the key.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings

import pytest
import torch
from torch import nn

from zero.config import ConfigError, NotSupportedError, load_config
from zero_comm.testing import run_ranks

BASE = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def _load(**extra):
    return load_config({**BASE, **extra})


def test_todays_keys_are_accepted_with_deepspeeds_values():
    cfg = _load(gradient_allreduce_op="MEAN", log_level="INFO", managed_gradient_accumulation=True,
                use_data_before_expert_parallelism=True, gradient_predivide_factor=2.0,
                compile={"offload_activation_pin_memory": False}, bf16={"enabled": True, "immediate_grad_update": True},
                zero_optimization={"stage": 3, "stage3_module_granularity_threshold": 5000,
                                   "stage3_prefetch_bucket_size": 0})  # fmt: skip
    assert (cfg.gradient_allreduce_op, cfg.log_level, cfg.managed_gradient_accumulation) == ("mean", "info", True)
    assert cfg.use_data_before_expert_parallelism and cfg.gradient_predivide_factor == 2.0
    assert cfg.compile.offload_activation_pin_memory is False and cfg.bf16.immediate_grad_update is True
    zo = cfg.zero_optimization
    assert (zo.stage3_module_granularity_threshold, zo.stage3_prefetch_bucket_size) == (5000, 0)
    plain = _load()  # DeepSpeed's defaults
    assert (plain.gradient_allreduce_op, plain.log_level, plain.managed_gradient_accumulation) == ("mean", None, True)
    assert plain.gradient_predivide_factor == 1.0 and plain.zero_optimization.stage3_module_granularity_threshold == 0


@pytest.mark.parametrize(
    ("extra", "error", "words"),
    [
        ({"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, ConfigError,
         ("'gradient_allreduce_op'", "stage 3")),
        ({"gradient_allreduce_op": "max"}, ConfigError, ("gradient_allreduce_op",)),
        ({"managed_gradient_accumulation": False}, NotSupportedError, ("'managed_gradient_accumulation'", "boundary")),
        ({"log_level": "verbose"}, ConfigError, ("log_level",)),
        ({"gradient_predivide_factor": 0.0}, ConfigError, ("gradient_predivide_factor",)),
        ({"zero_optimization": {"stage": 2, "allgather_bucket_size": 1001}}, ConfigError,
         ("allgather_bucket_size", "multiple of 2")),
        ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}}, ConfigError,
         ("stage3_prefetch_bucket_size",)),
    ],
)  # fmt: skip
def test_values_deepspeed_refuses_or_zero_lacks_name_the_key(extra, error, words):
    with pytest.raises(error) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load(**extra)
    assert all(w in str(info.value) for w in words), str(info.value)


class Block(nn.Module):
    """Two 4x4 linears: 40 elements over 3 layers, DeepSpeed's granularity 13."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(1, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _run(cfg: dict, steps: int = 2, optimizer=None) -> tuple:
    import zero

    model = _model()
    opt = optimizer(model) if optimizer is not None else None
    engine, *_ = zero.initialize(model=model, optimizer=opt, config=cfg)
    rank = torch.distributed.get_rank()
    for step in range(steps):
        engine.backward(engine(_x(rank, step)).square().mean())
        engine.step()
    return engine, list(engine.runtime.full_parameters().values())


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def behaviour_body(cfg_path: str) -> dict:
    import zero
    from zero.leaf_modules import get_z3_leaf_modules

    out = {}
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    z2, z3 = {**base, "zero_optimization": {"stage": 2}}, {**base, "zero_optimization": {"stage": 3}}
    # gradient_allreduce_op "sum": the ranks' gradients added (one SGD step shows the gradient itself)
    sgd = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 2}}  # fmt: skip
    out["sum"] = _run({**sgd, "gradient_allreduce_op": "sum"}, steps=1)[0].runtime.full_parameters()
    # gradient_predivide_factor: the same averaged gradient
    out["predivide"] = _same(_run(z2)[1], _run({**z2, "gradient_predivide_factor": 2.0})[1])
    # stage3_prefetch_bucket_size 0: no prefetch, the same training
    plain3 = _run(z3)[1]
    engine, params = _run({**base, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0}})
    out["prefetch"] = (engine.runtime.params.prefetch.prefetch_numel, _same(plain3, params))
    # stage3_module_granularity_threshold: DeepSpeed's leaves (both Blocks at 13, none at 12), the same training
    for threshold in (12, 13):
        zo = {"stage": 3, "stage3_module_granularity_threshold": threshold}
        engine, params = _run({**base, "zero_optimization": zo})
        marked = [type(m).__name__ for m in get_z3_leaf_modules(engine.module)]
        out[f"granularity{threshold}"] = (marked, _same(plain3, params), engine.zero_module_granularity_threshold())
    # bf16.immediate_grad_update: the same training either way (zero accumulates each micro-batch as it comes)
    b1 = {**base, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    b1i = {**b1, "bf16": {"enabled": True, "immediate_grad_update": True}}
    out["immediate"] = _same(_run(b1, steps=4)[1], _run(b1i, steps=4)[1])
    # log_level sets zero's logger; use_data_before_expert_parallelism is accepted
    _run({**z2, "log_level": "error", "use_data_before_expert_parallelism": True}, steps=0)
    out["log_level"] = logging.getLogger("zero").level
    logging.getLogger("zero").setLevel(logging.NOTSET)
    # a client optimizer with an optimizer section: DeepSpeed uses the client's
    sgd = []
    engine, params = _run(z2, optimizer=lambda m: sgd.append(torch.optim.SGD(m.parameters(), lr=0.1)) or sgd[0])
    out["client"] = (engine.optimizer is sgd[0], engine.optimizer_name(), engine.client_optimizer is sgd[0])
    # the deprecated args.deepscale_config still names the config file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zero.initialize(args=argparse.Namespace(deepscale_config=cfg_path), model=_model())
    out["deepscale"] = (engine.zero_optimization_stage(), any("deepscale_config" in str(w.message) for w in caught))
    # stage 0: loss.backward() outside engine.backward is refused; nested no_sync is refused
    engine, *_ = zero.initialize(model=_model(), config={**base, "zero_optimization": {"stage": 0}})
    try:
        engine(_x(0, 0)).sum().backward()
        out["direct"] = "no error"
    except RuntimeError as e:
        out["direct"] = str(e)
    engine.backward(engine(_x(0, 0)).sum())  # the engine's own backward still works
    with engine.no_sync():
        with pytest.raises(AssertionError, match="reentry"):
            with engine.no_sync():
                pass
    out["nested"] = True
    return out


def test_keys_behave_as_deepspeeds_on_two_ranks(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}))  # fmt: skip
    ref = _model()
    sum(ref(_x(r, 0)).square().mean() for r in range(2)).backward()  # the sum over the ranks, not the mean
    want = {n: (p - 0.1 * p.grad).detach() for n, p in ref.named_parameters()}
    for out in run_ranks(behaviour_body, 2, str(path), timeout=300):
        assert out["sum"].keys() == want.keys()
        for name, value in out["sum"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-6, atol=1e-7)
        assert out["predivide"]
        assert out["prefetch"] == (0, True)
        assert out["granularity12"] == ([], True, 12)
        assert out["granularity13"] == (["Block", "Block"], True, 13)  # one unit per Block, the same training
        assert out["immediate"]
        assert out["log_level"] == logging.ERROR
        assert out["client"] == (True, "SGD", True)
        assert out["deepscale"] == (1, True)
        assert "engine.backward(loss)" in out["direct"]
        assert out["nested"]
