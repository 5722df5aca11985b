"""The monitor sections of a DeepSpeed config: `tensorboard`, `wandb`, `csv_monitor`, `comet` (DeepSpeed's keys and
defaults, ``deepspeed/monitor/config.py``)."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import PositiveInt

_STRICT = pydantic.ConfigDict(extra="forbid")


class TensorBoardSection(pydantic.BaseModel):
    """`tensorboard`: event files under ``output_path/job_name`` (``torch.utils.tensorboard``; the extra
    ``tensorboard``)."""

    model_config = _STRICT
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbSection(pydantic.BaseModel):
    """`wandb`: a Weights & Biases run in ``project`` (``team`` is wandb's entity); ``WANDB_MODE=offline`` works."""

    model_config = _STRICT
    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


class CSVSection(pydantic.BaseModel):
    """`csv_monitor`: one CSV file per event under ``output_path/job_name``, rows ``step,<last part of the name>``."""

    model_config = _STRICT
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CometSection(pydantic.BaseModel):
    """`comet`: a Comet experiment (``comet_ml.start``); each event logged at most every ``samples_log_interval``
    samples."""

    model_config = _STRICT
    enabled: bool = False
    samples_log_interval: PositiveInt = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: Literal["get", "create", "get_or_create"] | None = None
