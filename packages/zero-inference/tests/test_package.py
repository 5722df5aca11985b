"""The installed package reports the version its pyproject.toml declares."""

import pathlib
import tomllib

import pytest

import zero_inference


@pytest.mark.smoke
def test_version_matches_pyproject():
    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert zero_inference.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
