"""TRL's trainers run unchanged on zero: one script (jobs/trl_job.py) that imports trl and transformers, never zero
or deepspeed, launched on 2 gloo ranks by ``zero run --as-deepspeed``, trains ``SFTTrainer`` at ZeRO-3 and
``DPOTrainer`` with a reference model at ZeRO-2 and at ZeRO-3, the DeepSpeed config given as the trainer config's
``deepspeed=``; then ``DPOTrainer`` again with the policy and the reference loaded from one saved model under a
user's own ZeRO-2 (overlapped reduction, clipping 1.0) and ZeRO-3 configs, where the first loss is log 2 and every
later one is compared. TRL's own ``prepare_deepspeed`` turns the reference model into a second engine, without an
optimizer: at ZeRO-2 a whole copy (stage 0), at ZeRO-3 partitioned. Reference: the same trainers under their
own CPU DDP (no DeepSpeed config), run first in the same launch, before any DeepSpeed config exists; fp32, every
logged loss equal to 1e-5 relative.

TRL's DPO config turns bf16 on by default; Accelerate then adds ``bf16.enabled`` to the DeepSpeed config and the
engine trains bf16 weights (as DeepSpeed does) while DDP keeps fp32 weights under bf16 autocast: the two differ
from the first forward, so these runs set ``bf16=False``.

TRL's SFT and DPO losses read the LM head's weight directly (a fused head, the head module never runs), gathered
with ``GatheredParameters`` in forward and again in backward: the ZeRO-3 runs check that gradient path end to end
(zero-core's tests/test_stage3_gathered_in_backward.py pins it without TRL).
"""

from __future__ import annotations

import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from zero_launch import zero_run_modes  # noqa: E402

# one launch running the DDP and then the zero trainers (its start-up, mostly importing trl, is paid once)
pytestmark = pytest.mark.timeout(900)
STEPS = ["1", "2", "3", "4"]
DDP = "torch.nn.parallel.distributed.DistributedDataParallel"


def _same_losses(got: dict, want: dict, name: str) -> None:
    assert sorted(want, key=int) == STEPS and sorted(got, key=int) == STEPS, name
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5), (name, step)


def test_trl_sft_and_dpo_trainers_on_zero_equal_their_ddp_runs(tmp_path):
    runs = zero_run_modes("trl_job.py", tmp_path, ("ddp", "zero"))
    zero, ddp = runs["zero"], runs["ddp"]
    for name in ("sft", "dpo"):
        assert (ddp[name]["wrapped"], ddp[name]["world"]) == (DDP, 2), name
    # the reference model is not the policy: DPO's first loss is not log 2, so it depends on the reference's values
    assert abs(ddp["dpo"]["losses"]["1"] - math.log(2)) > 1e-3

    sft = zero["sft_zero3"]
    assert (sft["wrapped"], sft["stage"], sft["world"]) == ("zero.engine.engine.Engine", 3, 2)
    _same_losses(sft["losses"], ddp["sft"]["losses"], "sft_zero3")

    for name, stage in (("dpo_zero2", 2), ("dpo_zero3", 3)):
        run = zero[name]
        assert (run["wrapped"], run["stage"], run["world"]) == ("zero.engine.engine.Engine", stage, 2), name
        # TRL's prepare_deepspeed: a forward-only engine, stage 0 (whole) under ZeRO-2, partitioned under ZeRO-3
        assert (run["reference"], run["reference_without_optimizer"]) == ("Engine", True), name
        assert run["reference_stage"] == (0 if stage == 2 else 3), name
        if stage == 2:
            assert run["reference_released"] == 0, name
        else:  # everything above the persistence threshold TRL sets (10 x hidden size) is released
            assert run["reference_released"] > 0 and run["reference_largest_whole"] <= 10 * run["hidden"], name
        _same_losses(run["losses"], ddp["dpo"]["losses"], name)

    # the policy and the reference start from the same weights (the first loss is log 2), explicit clipping, ZeRO-2
    # with overlapped reduction: the losses after the first update follow DDP, the reference stays as loaded
    want = ddp["dpo_same_start"]
    assert want["losses"]["1"] == pytest.approx(math.log(2), rel=1e-6)
    assert (want["reference_unchanged"], want["trained_dtype"]) == (True, "torch.float32")
    for name in ("dpo_same_start_zero2", "dpo_same_start_zero3"):
        run = zero[name]
        assert (run["reference_unchanged"], run["trained_dtype"]) == (True, "torch.float32"), name
        _same_losses(run["losses"], want["losses"], name)
