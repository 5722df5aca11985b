"""The autotuning session: profile, model memory, confirm micro-batches, search, write results.

1. Profile: one run at stage 0 and the smallest micro-batch, stopped after one optimizer step, measures Ψ, the
   optimizer's bytes per element and the activation bytes per sample (``zero.engine.autotune_probe``).
2. Memory model (``zero.autotune.memory``): per stage, the largest micro-batch that fits the budget; candidates
   predicted not to fit are recorded as ``not launched`` and never run.
3. Confirmation: per stage, that micro-batch is launched with the default knobs; if it fails, half of it, and so
   on: the largest micro-batch that really runs bounds the stage's space.
4. Search: the tuner picks among the remaining candidates (stage x micro-batches x knobs), each an experiment in a
   fresh process with a time limit; failures are recorded and skipped. The ``tuner_recheck_top_k`` best are then
   measured again (phase ``recheck``), and the winner is chosen on medians with ties within the measured noise
   (``zero.autotune.choice``).
5. Results in ``results_dir`` (``zero.autotune.results``).
Mirrors the flow of DeepSpeed's ``Autotuner.tune`` (deepspeed/autotuning/autotuner.py), with the memory model
measured instead of estimated from a fixed activation guess.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from zero.autotune import results as res
from zero.autotune.experiment import launch_command, run_experiment, with_config
from zero.autotune.memory import Dtypes, MemoryModel, ModelInfo, memory_budget
from zero.autotune.space import (
    Candidate,
    enumerate_space,
    knob_values,
    micro_batch_sizes,
    split_user_space,
    stages_to_tune,
)
from zero.autotune.tuners import Search, make_tuner


class AutotuneError(RuntimeError):
    """The session cannot go on (e.g. the profile run failed: without it nothing can be predicted)."""


@dataclass
class Job:
    """How to launch the user's script: ``script`` (path, or module with ``module=True``), its arguments, the index
    in them of the config path's value (``experiment.find_config_arg``) and the ranks on this machine."""

    script: str
    script_args: list[str]
    config_index: int
    nproc: int = 1
    module: bool = False
    arg_mappings: dict[str, str] | None = None

    def command(self, config_path: str, config: dict | None = None) -> list[str]:
        """The launch with ``config_path`` as the config; DeepSpeed's ``arg_mappings`` (config key, dotted for
        nested keys -> script flag) also pass ``config``'s values as script arguments."""
        args = with_config(self.script_args, self.config_index, config_path)
        for key, flag in (self.arg_mappings or {}).items():
            value = _dotted(config or {}, key)
            if value is None:
                continue
            if flag in args and args.index(flag) + 1 < len(args):
                args[args.index(flag) + 1] = str(value)
            else:
                args += [flag, str(value)]
        return launch_command(self.script, args, self.nproc, self.module)


def _dotted(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class Autotuner:
    """One session. ``tune()`` returns the best row (or None); ``best_config`` then holds its config.

    Args:
        job: the user's launch. user_config: the user's config dict (lists in ``zero_optimization`` are the space).
        env: environment of the experiments (default: this process's). log: where progress lines go.
    Raises: ValueError naming a bad ``autotuning`` or space key (from ``load_config`` / ``space``).
    """

    def __init__(self, job: Job, user_config: dict, env: dict | None = None, log: Callable[[str], None] = print):
        from zero.config import load_config

        self.job, self.env, self.log = job, env, log
        self.base, self.lists = split_user_space(user_config)
        self.base.pop("autotuning", None)
        self.at = load_config({**self.base, "autotuning": user_config.get("autotuning", {})}, job.nproc).autotuning
        self.stages = stages_to_tune(user_config, self.lists)
        self.rows: list[res.Row] = []
        self.best: res.Row | None = None
        self.best_config: dict | None = None
        self.best_config_path: str | None = None
        self.stop_reason = ""
        self.memory: MemoryModel | None = None
        self._configs: dict[Candidate, dict] = {}
        self._predicted: dict[Candidate, tuple[int, int]] = {}

    # --- helpers ----------------------------------------------------------------------------------------------
    def _sign(self) -> float:
        return -1.0 if self.at.metric == "latency" else 1.0

    def _exp_config(self, cand: Candidate, exp_dir: str, profile: bool = False) -> dict:
        cfg = cand.config(self.base)
        auto = {"enabled": True, "start_profile_step": self.at.start_profile_step,
                "end_profile_step": self.at.end_profile_step, "metric": self.at.metric}  # fmt: skip
        if profile:
            auto.update(model_info={"profile": True}, model_info_path=os.path.join(exp_dir, "metrics.json"))
        else:
            auto["metric_path"] = os.path.join(exp_dir, "metrics.json")
            cfg["wall_clock_breakdown"] = True  # the engine's timers measure the step
            if self.at.metric == "flops":
                cfg["flops_profiler"] = {"enabled": True, "profile_step": self.at.start_profile_step,
                                         "output_file": os.path.join(exp_dir, "flops.txt")}  # fmt: skip
        cfg["steps_per_print"] = 10**9
        cfg["autotuning"] = auto
        return cfg

    def _launch(self, cand: Candidate, phase: str, profile: bool = False) -> res.Row:
        from zero.config import ConfigError, load_config

        exp = len(self.rows)
        name = "profile_model_info" if profile else cand.name
        exp_dir = os.path.join(self.at.exps_dir, f"{exp:03d}_{name}")
        os.makedirs(exp_dir, exist_ok=True)
        cfg = self._exp_config(cand, exp_dir, profile)
        row = res.Row(exp, name, phase, cand.stage, cand.micro_batch, dict(cand.knobs))
        if cand in self._predicted:
            row.predicted_model_state_bytes, row.predicted_peak_bytes = self._predicted[cand]
        try:
            load_config(cfg, self.job.nproc)
        except (ConfigError, ValueError) as e:  # checked here, before a process is spent on it
            row.status, row.reason = "invalid", str(e)
            return self._record(row)
        path = os.path.join(exp_dir, "ds_config.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
        self.log(f"zero autotune: experiment {exp} {name} ({phase}) ...")
        out = run_experiment(self.job.command(path, cfg), exp_dir, self.at.experiment_timeout, self.env)
        row.status, row.reason, row.seconds = out.status, out.reason, out.seconds
        m = out.metrics
        row.measured_model_state_bytes, row.measured_peak_bytes = m.get("model_state_bytes"), m.get("peak_bytes")
        if out.status == "ok" and not profile:
            row.latency_s, row.throughput, row.flops_per_gpu = m["latency"], m["throughput"], m.get("FLOPS_per_gpu")
            value = {"latency": row.latency_s, "throughput": row.throughput, "flops": row.flops_per_gpu}
            row.metric = value[self.at.metric]
            if row.metric is None:
                row.status, row.reason = "failed", "no FLOPs measured (flops_profiler gave none)"
        self._configs[cand] = cfg
        self.log(f"zero autotune:   {row.status} {row.reason} metric={row.metric} ({row.seconds:.1f} s)")
        return self._record(row)

    def config_of(self, row: res.Row) -> dict:
        """The experiment config (``autotuning`` keys included) that produced ``row``. Raises KeyError if none."""
        return copy.deepcopy(self._configs[Candidate(row.stage, row.micro_batch, tuple(sorted(row.knobs.items())))])

    def _record(self, row: res.Row) -> res.Row:
        self.rows.append(row)
        res.write_rows(self.at.results_dir, self.rows)
        return row

    def _evaluate(self) -> Callable[[Candidate], float | None]:
        def evaluate(cand: Candidate) -> float | None:
            row = self._launch(cand, "recheck" if cand in self._configs else "tune")
            return None if row.metric is None else self._sign() * row.metric

        return evaluate

    # --- the session --------------------------------------------------------------------------------------------
    def profile(self) -> ModelInfo:
        """Step 1. Raises AutotuneError with the experiment's reason when the profile run fails."""
        cand = Candidate(0, self.at.min_train_micro_batch_size_per_gpu)
        row = self._launch(cand, "profile", profile=True)
        if row.status != "ok":
            raise AutotuneError(f"the model profile run failed ({row.status}: {row.reason}); see "
                                f"{self.at.exps_dir} for its logs")  # fmt: skip
        exp_dir = os.path.join(self.at.exps_dir, f"{row.exp:03d}_profile_model_info")
        return ModelInfo.load(os.path.join(exp_dir, "metrics.json"))

    def memory_model(self, info: ModelInfo) -> MemoryModel:
        """Step 2: the model with the config's precision and the budget (configured, or measured here)."""
        from zero.config import load_config
        from zero.engine.precision import precision_policy

        cfg = load_config(Candidate(0, 1).config(self.base), self.job.nproc)
        policy = precision_policy(cfg, "cuda" if _cuda() else "cpu")
        budget = memory_budget(self.job.nproc, self.at.memory_per_rank)
        self.log(f"zero autotune: {info.num_params} parameters, {info.activation_bytes_per_sample / 2**20:.2f} MiB "
                 f"activations per sample, budget {budget / 2**20:.0f} MiB per rank")  # fmt: skip
        return MemoryModel(info, self.job.nproc, Dtypes.of(policy), budget)

    def _predict(self, cand: Candidate) -> tuple[int, int]:
        zo = self.base.get("zero_optimization") or {}
        threshold = cand.knob("stage3_param_persistence_threshold", zo.get("stage3_param_persistence_threshold", 1e5))
        bucket = cand.knob("reduce_bucket_size", zo.get("reduce_bucket_size", 5e8))
        pred = self.memory.predict(cand.stage, cand.micro_batch, int(threshold), int(bucket))
        return pred.model_states, pred.total

    def _bounds(self) -> tuple[int, int]:
        """Micro-batch bounds per rank: the ``*_micro_batch_size_per_gpu`` keys, narrowed so that micro-batch x
        accumulation steps x ranks stays within ``min_train_batch_size``..``max_train_batch_size``."""
        per_mb = int(self.base.get("gradient_accumulation_steps") or 1) * self.job.nproc
        hi = self.at.max_train_micro_batch_size_per_gpu
        if self.at.max_train_batch_size:
            hi = min(hi, self.at.max_train_batch_size // per_mb)
        lo = max(self.at.min_train_micro_batch_size_per_gpu, -(-self.at.min_train_batch_size // per_mb))
        return lo, hi

    def _largest(self, stage: int) -> int | None:
        lo, hi = self._bounds()
        return self.memory.largest_micro_batch(stage, lo, hi) if hi >= lo else None

    def confirm(self, stage: int, knobs: dict[str, list]) -> int | None:
        """Step 3 for ``stage``: the largest micro-batch that fits by the model and also runs, or None."""
        largest = self._largest(stage)
        default = tuple((k, v[0]) for k, v in sorted(knobs.items()))
        if largest is None:
            cand = Candidate(stage, self._bounds()[0], default)
            ms, total = self._predict(cand)
            self._record(res.Row(len(self.rows), cand.name, "memory", stage, cand.micro_batch, dict(default),
                                 "not launched", f"predicted {total / 2**20:.0f} MiB > budget "
                                 f"{self.memory.budget / 2**20:.0f} MiB", predicted_model_state_bytes=ms,
                                 predicted_peak_bytes=total))  # fmt: skip
            return None
        mb = largest
        while mb >= self._bounds()[0]:
            cand = Candidate(stage, mb, default)
            self._predicted[cand] = self._predict(cand)
            row = self._launch(cand, "confirm")
            self.confirmed[cand] = None if row.metric is None else self._sign() * row.metric
            if row.metric is not None:
                return mb
            mb //= 2
        return None

    def tune(self) -> res.Row | None:
        """Run the session (steps 1-5); returns the best row or None. Raises AutotuneError (profile failed)."""
        start = time.perf_counter()
        for d in (self.at.results_dir, self.at.exps_dir):
            if self.at.overwrite and os.path.isdir(d):
                shutil.rmtree(d)
            os.makedirs(d, exist_ok=True)
        info = self.profile()
        self.memory = self.memory_model(info)
        self.confirmed: dict[Candidate, float | None] = {}
        space: list[Candidate] = []
        for stage in self.stages:
            knobs = knob_values(stage, self.base, self.lists, self.at.fast, info.num_params)
            top = self.confirm(stage, knobs)
            if top is None:
                continue
            mbs = micro_batch_sizes(top, self._bounds()[0], self.at.num_tuning_micro_batch_sizes)
            for cand in enumerate_space(stage, mbs, knobs):
                self._predicted[cand] = self._predict(cand)
                if self._predicted[cand][1] <= self.memory.budget:
                    space.append(cand)
        space = [c for c in space if c not in self.confirmed]
        tuner = make_tuner(self.at.tuner_type, space)
        search = Search(tuner, self.at.tuner_num_trials, self.at.tuner_early_stopping, self.confirmed,
                        self.at.tuner_recheck_top_k)  # fmt: skip
        search.run(self._evaluate())
        self.stop_reason = search.stop_reason
        if search.noise is not None:
            self.stop_reason += f"; measured noise {100 * search.noise:.1f}% per run"
        self._finish(time.perf_counter() - start, search)
        return self.best

    def _finish(self, total_s: float, search: Search) -> None:
        cand = search.choice
        if cand is not None:
            # The chosen candidate's last successful row, its metric replaced by the median of its measurements.
            last = [r for r in self.rows if r.metric is not None and r.phase in ("confirm", "tune", "recheck")
                    and Candidate(r.stage, r.micro_batch, tuple(sorted(r.knobs.items()))) == cand][-1]  # fmt: skip
            samples = search.samples[cand]
            self.best = dataclasses.replace(last, metric=self._sign() * search.tried[cand],
                                            reason=f"median of {len(samples)} measurement(s)")  # fmt: skip
            self.best_config = copy.deepcopy(self._configs[cand])
            for key in ("autotuning", "wall_clock_breakdown", "flops_profiler", "steps_per_print"):
                self.best_config.pop(key, None)
            for key in ("wall_clock_breakdown", "flops_profiler", "steps_per_print"):
                if key in self.base:
                    self.best_config[key] = self.base[key]
            path = os.path.join(self.at.results_dir, "ds_config_optimal.json")
            self.best_config_path = res.write_best(
                self.at.results_dir, self.best_config, self.job.command(path, self.best_config)
            )
        text = res.summary_table(self.rows, self.at.metric, self.best, self.stop_reason, total_s)
        with open(os.path.join(self.at.results_dir, "summary.txt"), "w") as f:
            f.write(text + "\n")
        res.plot_metric(os.path.join(self.at.results_dir, "metric.png"), self.rows, self.at.metric)
        self.log(text)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
