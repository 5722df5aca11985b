"""Bad input of every kind (a config key, a command-line flag, a data file) is one family a caller can catch."""

import pytest

import zero
from zero.commands.errors import UsageError
from zero.config import ConfigError, NotSupportedError
from zero.errors import InputError
from zero.train.data import DataError, build_corpus


@pytest.mark.parametrize("cls", [ConfigError, NotSupportedError, UsageError, DataError])
def test_each_bad_input_error_is_an_input_error(cls):
    assert issubclass(cls, InputError)


def test_a_bad_config_key_and_a_missing_data_file_are_caught_as_input_errors(tmp_path):
    with pytest.raises(InputError, match="train_batch_sizee"):
        zero.config.load_config({"train_batch_sizee": 8}, 1)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match="nope.jsonl.*does not exist"):
        build_corpus(str(missing), "text", None)


def test_usage_error_stays_importable_from_the_cli_module():
    from zero.cli import UsageError as FromCli

    assert FromCli is UsageError
