"""The `autotuning` section: DeepSpeed's keys and defaults load; bad values are errors naming the key."""

import pytest

from zero.cli import main
from zero.config import ConfigError, load_config


def test_deepspeed_keys_and_defaults():
    at = load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": {"enabled": True}}).autotuning
    assert (at.fast, at.start_profile_step, at.end_profile_step, at.metric, at.tuner_type) == (
        True, 3, 5, "throughput", "gridsearch")  # fmt: skip
    assert (at.tuner_early_stopping, at.tuner_num_trials, at.results_dir, at.exps_dir) == (
        5, 50, "autotuning_results", "autotuning_exps")  # fmt: skip
    assert (at.min_train_micro_batch_size_per_gpu, at.max_train_micro_batch_size_per_gpu) == (1, 1024)
    assert at.num_tuning_micro_batch_sizes == 3 and at.mp_size == 1 and at.model_info is None


@pytest.mark.parametrize(
    "section,needle",
    [({"tuner_type": "bayes"}, "autotuning.tuner_type"), ({"mp_size": 2}, "autotuning.mp_size"),
     ({"start_profile_step": 6}, "end_profile_step"), ({"metrik": "latency"}, "autotuning.metrik")],
)  # fmt: skip
def test_bad_values_name_the_key(section, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config({"train_micro_batch_size_per_gpu": 1, "autotuning": section})


def test_cli_errors_before_any_experiment(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text('{"train_micro_batch_size_per_gpu": 1}')
    assert main(["autotune", "train.py", "--lr", "1"]) == 2  # no config argument to hand each experiment
    assert "takes no config argument" in capsys.readouterr().err
    assert main(["autotune", "--nproc-per-node", "0", "train.py", "--config", str(cfg)]) == 2
    assert main(["run", "--autotuning=sweep", "train.py"]) == 2
    assert "'tune' or 'run'" in capsys.readouterr().err


def test_train_batch_bounds_narrow_the_micro_batch():
    from zero.autotune import Autotuner, Job

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
           "autotuning": {"min_train_batch_size": 12, "max_train_batch_size": 40,
                          "max_train_micro_batch_size_per_gpu": 64}}  # fmt: skip
    tuner = Autotuner(Job("train.py", ["--config", "ds.json"], 1, nproc=2), cfg, log=lambda s: None)
    assert tuner._bounds() == (3, 10)  # micro-batch x 2 accumulation steps x 2 ranks within 12..40
