"""Every DeepSpeed section zero still rejects says why in one line and what to use instead; the sections this
package now implements (monitors, torch_autocast, activation-checkpointing options, the other optimizers) load."""

import pytest

from zero.config import NotSupportedError, load_config
from zero.config.legacy import UNSUPPORTED_TOP
from zero.config.unsupported_why import WHY


@pytest.mark.parametrize("key", UNSUPPORTED_TOP)
def test_rejected_section_says_why_and_what_instead(key):
    with pytest.raises(NotSupportedError) as err:
        load_config({"train_batch_size": 1, key: {"enabled": True}})
    msg = str(err.value)
    assert f"config key '{key}'" in msg and WHY[key] in msg and "\n" not in msg


def test_every_rejected_section_has_a_reason():
    assert set(UNSUPPORTED_TOP) <= set(WHY)


def test_newly_supported_sections_load():
    cfg = load_config({
        "train_batch_size": 2,
        "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "j"},
        "wandb": {"enabled": True, "project": "p", "team": "t", "group": "g"},
        "csv_monitor": {"enabled": True, "output_path": "csv", "job_name": "j"},
        "comet": {"enabled": True, "samples_log_interval": 10, "project": "p", "mode": "get_or_create"},
        "torch_autocast": {"enabled": True, "dtype": "bf16", "lower_precision_safe_modules": ["torch.nn.Linear"]},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                     "contiguous_memory_optimization": True, "number_checkpoints": 4,
                                     "synchronize_checkpoint_boundary": True, "profile": True},
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10, "cuda_aware": False,
                                                       "comm_backend_name": "nccl"}},
    }, 2)  # fmt: skip
    assert cfg.tensorboard.enabled and cfg.torch_autocast.enabled and cfg.activation_checkpointing.profile
    assert cfg.optimizer.typed_params().freeze_step == 10


@pytest.mark.parametrize("opt", ["Lamb", "Adagrad", "Lion", "ZeroOneAdam", "OneBitLamb"])
def test_other_optimizer_types_validate_their_params(opt):
    cfg = load_config({"train_batch_size": 1, "optimizer": {"type": opt, "params": {"lr": 0.01}}})
    assert cfg.optimizer.typed_params().lr == 0.01
    from zero.config import ConfigError

    with pytest.raises(ConfigError, match="optimizer.params"):
        load_config({"train_batch_size": 1, "optimizer": {"type": opt, "params": {"max_grad_norm": 1.0}}})
