"""Two features that would each replace the same store of zero's core are refused, naming both config keys, before
any work: DeepCompile's compiled parameter store (``compile.deepcompile`` at stage 3) and parameter offload
(``zero_optimization.offload_param``) once ran with the offload store silently replacing the compiled one."""

from __future__ import annotations

import pytest
import torch

import zero
from zero.config import ConfigError
from zero.engine.seams import SeamClaims


def test_a_seam_takes_one_feature_and_off_features_claim_nothing():
    seams = SeamClaims()
    seams.claim("param_store", None, "zero_optimization.offload_param")  # off: nothing claimed
    first = object()
    seams.claim("param_store", first, "compile.deepcompile")
    seams.claim("master_store", None, "compile.offload_opt_states")
    with pytest.raises(ConfigError) as err:
        seams.claim("param_store", object(), "zero_optimization.offload_param")
    assert "compile.deepcompile" in str(err.value) and "zero_optimization.offload_param" in str(err.value)
    assert seams.stores == {"param_store": first} and seams.claimed_by == {"param_store": "compile.deepcompile"}
    with pytest.raises(ValueError, match="unknown seam 'param'"):
        seams.claim("param", first, "compile.deepcompile")


def test_deepcompile_with_parameter_offload_is_refused_at_initialize():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
           "compile": {"deepcompile": True}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    assert "compile.deepcompile" in str(err.value) and "zero_optimization.offload_param" in str(err.value)
