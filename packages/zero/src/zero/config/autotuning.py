"""The `autotuning` section: DeepSpeed 0.19.8's keys and defaults (``deepspeed/autotuning/constants.py``).

``zero autotune`` (and ``zero run --autotuning tune|run``) reads it from the user's config; the experiments it
launches carry ``metric_path`` (or ``model_info.profile`` with ``model_info_path``), which makes the engine measure
steps ``start_profile_step``..``end_profile_step``, write the metrics and exit (see ``zero.engine.autotune_probe``).
Unlike DeepSpeed, ``enabled: true`` alone never stops a real training run: only those paths do.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

_STRICT = pydantic.ConfigDict(extra="forbid")


class ModelInfoSection(pydantic.BaseModel):
    """`autotuning.model_info`: ``profile: true`` makes the engine profile one step (parameters, activation bytes
    per sample) and write ``model_info_path``. The other keys are DeepSpeed's hints, accepted and recorded."""

    model_config = _STRICT
    profile: bool = False
    num_params: PositiveInt | None = None
    hidden_size: PositiveInt | None = None
    num_layers: PositiveInt | None = None


class AutotuningSection(pydantic.BaseModel):
    """`autotuning` (DeepSpeed keys, DeepSpeed defaults) plus three keys of zero's own, marked below.

    * ``fast`` (true): tune micro-batch size and stage only; false: also the bucket, stage-3 and overlap knobs.
    * ``metric``: ``throughput`` (samples/s, higher is better), ``latency`` (seconds per optimizer step, lower is
      better) or ``flops`` (FLOP/s per rank from the FLOPs profiler, higher is better).
    * ``tuner_type``: ``gridsearch`` | ``random`` | ``model_based``; ``tuner_num_trials`` caps the experiments,
      ``tuner_early_stopping`` stops after that many experiments without a better metric.
    * micro-batch sizes tried lie within ``min/max_train_micro_batch_size_per_gpu`` and keep micro-batch x
      accumulation steps x ranks within ``min/max_train_batch_size``; ``num_tuning_micro_batch_sizes`` of them, from
      the largest that fits down, halving.
    * ``mp_size``: model-parallel degree; zero has no model parallelism, so only 1 is valid.
    * ``memory_per_rank`` (zero's key): the memory budget in bytes per rank; default: the accelerator's free memory,
      or on CPU the host's available memory divided by the ranks.
    * ``experiment_timeout`` (zero's key): seconds one experiment may run before it is killed and recorded as failed.
    * ``tuner_recheck_top_k`` (zero's key): after the search, the k best candidates are measured once more each,
      interleaved, within ``tuner_num_trials``; the winner is decided on medians, ties within the measured noise
      going to the candidate measured more often (``zero.autotune.choice``). 0: DeepSpeed's rule,
      the best single measurement.
    """

    model_config = _STRICT
    enabled: bool = False
    fast: bool = True
    results_dir: str = Field("autotuning_results", min_length=1)
    exps_dir: str = Field("autotuning_exps", min_length=1)
    overwrite: bool = True
    start_profile_step: PositiveInt = 3
    end_profile_step: PositiveInt = 5
    metric_path: str | None = None
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: PositiveInt = 5
    tuner_num_trials: PositiveInt = 50
    arg_mappings: dict[str, str] | None = None
    model_info: ModelInfoSection | None = None
    model_info_path: str | None = None
    mp_size: Literal[1] = 1
    max_train_batch_size: PositiveInt | None = None
    min_train_batch_size: PositiveInt = 1
    max_train_micro_batch_size_per_gpu: PositiveInt = 1024
    min_train_micro_batch_size_per_gpu: PositiveInt = 1
    num_tuning_micro_batch_sizes: PositiveInt = 3
    memory_per_rank: NonNegativeInt | None = None
    experiment_timeout: PositiveFloat = 600.0
    tuner_recheck_top_k: NonNegativeInt = 2

    @pydantic.model_validator(mode="after")
    def _ordered(self) -> AutotuningSection:
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"autotuning.end_profile_step ({self.end_profile_step}) must be >= start_profile_step "
                             f"({self.start_profile_step})")  # fmt: skip
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError("autotuning.max_train_micro_batch_size_per_gpu must be >= "
                             "min_train_micro_batch_size_per_gpu")  # fmt: skip
        return self
